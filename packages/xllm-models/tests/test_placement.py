"""Weight placement (xllm.models.placement): a loaded model's streamed weights gathered into one huge-page
arena in streaming order, its outputs unchanged (against the same model on ordinary memory), and the
arena on 2 MiB pages where the kernel offers transparent huge pages."""

from __future__ import annotations

import pathlib

import pytest
import torch

from xllm.kernels.hugepages import HugePageArena
from xllm.models import load_model
from xllm.models.placement import StreamsWeights
from xllm.testing.models import save_random_hf_model
from xllm.testing.reference import full_logits

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-5)
    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_hf_model(path, cfg, seed=3)
    return path


def _span(tensors: list[torch.Tensor]) -> int:
    starts = [t.data_ptr() for t in tensors]
    return max(p + t.numel() * t.element_size() for p, t in zip(starts, tensors)) - min(starts)


def _thp_offered() -> bool:
    path = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.is_file() and ("[always]" in path.read_text() or "[madvise]" in path.read_text())


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages of the mapping holding ``addr`` (/proc/self/smaps)."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("dtype,quantization", [(torch.bfloat16, "none"), (torch.float32, "none"),
                                                (torch.float32, "int8")])
def test_weights_gathered_in_one_arena_outputs_unchanged(tiny_dir, monkeypatch, dtype, quantization):
    placed = load_model(tiny_dir, dtype, progress=False, quantization=quantization)
    monkeypatch.setenv("XLLM_HUGEPAGES", "0")
    ordinary = load_model(tiny_dir, dtype, progress=False, quantization=quantization)
    assert isinstance(placed, StreamsWeights)
    tensors = list({id(t): t for t in placed.streamed_tensors()}.values())
    assert len(tensors) > 4 * 2  # every projection of both layers, their packed copies, the embedding / head
    # one region, in order, nothing else in between: the span is the tensors' bytes plus alignment
    assert _span(tensors) <= HugePageArena.bytes_for(tensors)
    ptrs = [t.data_ptr() for t in tensors]
    assert ptrs == sorted(ptrs)
    ids = torch.randint(0, 4096, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    assert torch.equal(full_logits(placed, ids), full_logits(ordinary, ids))
    if _thp_offered():
        assert _anon_huge_kb(ptrs[0]) > 0, "the weights are not on huge pages"
