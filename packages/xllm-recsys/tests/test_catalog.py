"""The CSR item catalogue against the dict trie (the oracle), its file formats and its errors."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from xllm.recsys import ItemTrie
from xllm.recsys.beam_topk import BeamCandidate, beam_topk, topk_candidates
from xllm.recsys.catalog import ItemCatalog


@pytest.fixture(scope="module")
def items():
    rng = np.random.default_rng(0)
    return rng.integers(0, 12, size=(400, 3))


def test_catalogue_lookups_equal_the_dict_trie(items):
    cat, trie = ItemCatalog(items), ItemTrie(items.tolist())
    assert cat.num_items == trie.num_items - (len(items) - len({tuple(r) for r in items.tolist()}))
    prefixes = [(), *sorted({tuple(r[:d]) for r in items.tolist() for d in (1, 2)}), (11, 11), (99,)]
    for p in prefixes:
        assert cat.allowed(p) == trie.allowed(p), p
    for r in items.tolist()[:50]:
        assert cat.is_item(r) and cat.items[cat.node_of(r)].tolist() == r
        assert items[cat.item_id(cat.node_of(r))].tolist() == r  # the file row holds these tokens
    assert not cat.is_item((1, 2)) and not cat.is_item((50, 1, 1))
    # the batched lookup: each node's children, padded
    depth1 = sorted({tuple(r[:1]) for r in items.tolist()})
    nodes = torch.tensor([cat.node_of(p) for p in depth1])
    ch = cat.children(1, nodes)
    for b, p in enumerate(depth1):
        assert ch.tokens[b][ch.valid[b]].tolist() == trie.allowed(p)
        assert cat.level_tokens[1][ch.first[b]] == trie.allowed(p)[0]
    mask = cat.logit_mask([list(p) for p in depth1], 20)
    assert torch.equal(mask, trie.logit_mask(list(depth1), 20))


def test_catalogue_files_load_alike(tmp_path, items):
    np.save(tmp_path / "a.npy", items.astype(np.int32))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in items.tolist()) + "\n\n")
    a, b = ItemCatalog.load(tmp_path / "a.npy"), ItemCatalog.load(tmp_path / "a.jsonl")
    assert torch.equal(a.items, b.items) and torch.equal(a.item_ids, b.item_ids)
    a.save_npy(tmp_path / "b.npy")
    assert ItemCatalog.load(tmp_path / "b.npy").num_items == a.num_items
    (tmp_path / "bad.jsonl").write_text("[1, 2, 3]\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl"):
        ItemCatalog.load(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match=">= 0"):
        ItemCatalog([[1, -2, 3]])


def test_vectorized_selection_equals_the_heap_and_a_full_sort():
    rnd = random.Random(5)
    for _ in range(30):
        beams, width, keep = rnd.randint(1, 12), rnd.randint(1, 30), rnd.randint(1, 20)
        lists = [sorted((rnd.gauss(0, 2) for _ in range(width)), reverse=True) for _ in range(beams)]
        scores = sorted((rnd.gauss(0, 3) for _ in range(beams)), reverse=True)
        heap, examined = beam_topk(scores, lists, keep)
        got = topk_candidates(torch.tensor(scores, dtype=torch.float64), torch.tensor(lists, dtype=torch.float64),
                              keep)
        every = sorted(((scores[b] + lp, b, r) for b in range(beams) for r, lp in enumerate(lists[b])),
                       key=lambda c: -c[0])[:keep]
        assert [(c.beam, c.rank) for c in heap] == [(b, r) for _, b, r in every]
        assert list(zip(got.beams.tolist(), got.cols.tolist(), strict=True)) == [(b, r) for _, b, r in every]
        assert got.scanned <= examined  # the final bound never scans more than the growing heap did
        assert isinstance(heap[0], BeamCandidate)
