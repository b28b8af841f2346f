"""prefill_attention / decode_attention against a naive softmax(QK^T)V reference.

The caches are filled with NaN everywhere a sequence has no valid token, so a
kernel that reads (and does not properly discard) memory past a sequence's
length fails instead of silently passing on zeros.
"""

from __future__ import annotations

import pytest
import torch

from xllm.kernels import decode_attention, prefill_attention

H, KVH, D, DV = 6, 2, 16, 12
NUM_SLOTS, MAX_LEN = 5, 40


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_limit: list[int], scale: float):
    """q ``[n, H, D]``, k/v ``[L, KVH, *]``; query row ``j`` sees keys ``[0, key_limit[j])`` (float64 loops)."""
    n, heads = q.shape[0], q.shape[1]
    rep = heads // k.shape[1]
    out = torch.zeros(n, heads, v.shape[-1], dtype=torch.float64)
    for j in range(n):
        for h in range(heads):
            kh = k[: key_limit[j], h // rep].double()
            vh = v[: key_limit[j], h // rep].double()
            w = torch.softmax((kh @ q[j, h].double()) * scale, dim=0)
            out[j, h] = w @ vh
    return out


def make_cache(lengths: dict[int, int], dtype=torch.float32, seed=0):
    """K/V caches with random entries at ``[slot, :length]`` and NaN elsewhere."""
    g = torch.Generator().manual_seed(seed)
    k = torch.full((NUM_SLOTS, MAX_LEN, KVH, D), float("nan"), dtype=dtype)
    v = torch.full((NUM_SLOTS, MAX_LEN, KVH, DV), float("nan"), dtype=dtype)
    for slot, n in lengths.items():
        k[slot, :n] = torch.randn(n, KVH, D, generator=g).to(dtype)
        v[slot, :n] = torch.randn(n, KVH, DV, generator=g).to(dtype)
    return k, v


def test_prefill_varlen_chunks_with_offsets_and_gqa():
    # (slot, chunk length n, context length): a fresh prompt, a chunk continuing at offset 9,
    # a single-token chunk at offset 20 and a second fresh prompt.
    seqs = [(3, 7, 7), (0, 5, 14), (4, 1, 21), (1, 11, 11)]
    k_cache, v_cache = make_cache({slot: ctx for slot, _, ctx in seqs})
    starts = [0]
    for _, n, _ in seqs:
        starts.append(starts[-1] + n)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(starts[-1], H, D, generator=g)
    scale = D**-0.5
    out = prefill_attention(q, k_cache, v_cache, [s for s, _, _ in seqs], starts, [c for _, _, c in seqs], scale)
    assert out.shape == (starts[-1], H, DV)
    assert torch.isfinite(out).all()
    for i, (slot, n, ctx) in enumerate(seqs):
        offset = ctx - n
        ref = naive_attention(q[starts[i]:starts[i + 1]], k_cache[slot], v_cache[slot],
                              [offset + j + 1 for j in range(n)], scale)
        assert torch.allclose(out[starts[i]:starts[i + 1]].double(), ref, atol=1e-5, rtol=1e-5), f"sequence {i}"


def test_prefill_in_chunks_equals_prefill_at_once():
    k_cache, v_cache = make_cache({2: 23}, seed=2)
    q = torch.randn(23, H, D, generator=torch.Generator().manual_seed(3))
    full = prefill_attention(q, k_cache, v_cache, [2], [0, 23], [23], 0.3)
    parts = [prefill_attention(q[a:b], k_cache, v_cache, [2], [0, b - a], [b], 0.3)
             for a, b in ((0, 7), (7, 8), (8, 23))]
    assert torch.allclose(torch.cat(parts), full, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_decode_varying_lengths_and_slots(dtype, tol):
    # Non-contiguous, unordered slots; lengths from 1 to MAX_LEN.
    slots = [4, 0, 2, 3]
    lens = [1, 17, MAX_LEN, 6]
    k_cache, v_cache = make_cache(dict(zip(slots, lens)), dtype=dtype, seed=4)
    q = torch.randn(len(slots), H, D, generator=torch.Generator().manual_seed(5)).to(dtype)
    scale = D**-0.5
    out = decode_attention(q, k_cache, v_cache, torch.tensor(slots), torch.tensor(lens), scale)
    assert out.shape == (len(slots), H, DV) and out.dtype == dtype
    assert torch.isfinite(out.float()).all(), "memory past a sequence's length leaked into the result"
    for b, (slot, n) in enumerate(zip(slots, lens)):
        ref = naive_attention(q[b:b + 1], k_cache[slot], v_cache[slot], [n], scale)
        assert torch.allclose(out[b:b + 1].double(), ref, atol=tol, rtol=tol), f"row {b}"


def test_decode_single_key_returns_its_value_and_does_not_mutate_cache():
    k_cache, v_cache = make_cache({1: 1, 2: 9}, seed=6)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q = torch.randn(2, H, D)
    out = decode_attention(q, k_cache, v_cache, torch.tensor([1, 2]), torch.tensor([1, 9]), 1.0)
    rep = H // KVH
    for h in range(H):
        assert torch.allclose(out[0, h], v_cache[1, 0, h // rep])
    assert torch.equal(k_cache.nan_to_num(7.0), before_k.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), before_v.nan_to_num(7.0))


def test_decode_equals_last_row_of_prefill():
    k_cache, v_cache = make_cache({0: 30, 3: 12}, seed=7)
    q = torch.randn(2, H, D, generator=torch.Generator().manual_seed(8))
    dec = decode_attention(q, k_cache, v_cache, torch.tensor([0, 3]), torch.tensor([30, 12]), 0.25)
    pre = prefill_attention(q, k_cache, v_cache, [0, 3], [0, 1, 2], [30, 12], 0.25)
    assert torch.allclose(dec, pre, atol=1e-6)


def test_head_counts_must_be_divisible():
    k_cache = torch.zeros(1, 4, 4, D)  # 4 KV heads
    v_cache = torch.zeros(1, 4, 4, D)
    q = torch.zeros(1, 6, D)           # 6 query heads
    with pytest.raises(ValueError, match="divisible"):
        decode_attention(q, k_cache, v_cache, torch.tensor([0]), torch.tensor([2]), 1.0)
