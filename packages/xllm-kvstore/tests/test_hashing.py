import subprocess
import sys

import pytest

from xllm.kvstore import ROOT_HASH, block_hashes, hash_block


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(33)), 16)) == 2
    assert block_hashes(list(range(15)), 16) == []


def test_equal_hash_means_equal_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 9], 4)
    c = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] == b[0] and a[1] != b[1]
    # same second block, different first block: chaining makes the second hash differ
    assert a[1] != c[1] and a[0] != c[0]


def test_chain_is_incremental():
    toks = list(range(40))
    full = block_hashes(toks, 8)
    tail = block_hashes(toks[16:], 8, parent=full[1])
    assert full[2:] == tail
    assert full[0] == hash_block(ROOT_HASH, toks[:8])


def test_extra_namespace_changes_hash():
    assert block_hashes([1, 2, 3, 4], 4, extra=b"lora-a") != block_hashes([1, 2, 3, 4], 4)


def test_hash_is_stable_across_processes():
    code = "from xllm.kvstore import block_hashes; print(block_hashes(list(range(64)), 16))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert len(outs) == 1
    assert outs.pop().strip() == str(block_hashes(list(range(64)), 16))


def test_bad_block_size():
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)


def test_kvstore_index_half_imports_without_torch():
    code = "import sys, xllm.kvstore; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
