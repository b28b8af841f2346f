"""Decode rows (one query token per sequence) of the native attention over long contexts, against a float64 oracle.

Both entries: the varlen attention with only decode rows (the general step's path) and ``decode_attention``
(which also stores the step's K/V first). With at least 4 rows per thread a work item is a whole row (all its
KV heads in one pass over its positions; on AMX the single-pass kernel of attend_decode_amx.h), with fewer rows
one KV head: both layouts are checked, and a row's output must not depend on which one ran. Every cache row past
a context holds NaN/Inf bit patterns, so reading past the context (or letting masked lanes into a sum) fails.
"""

from __future__ import annotations

import pytest
import torch

from xllm.kernels import decode_attention, native
from xllm.kernels.attention import _native_prefill_attention

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"native kernels unavailable: {native.unavailable_reason()}")

# block edges of the kernels (16-key AMX steps, 32-key blocks, 16-position prefetch) and long contexts
CONTEXTS = [1, 2, 15, 16, 17, 31, 32, 33, 47, 100, 257, 300, 513, 1000, 1500, 2000]


def garbage(shape, dtype, gen) -> torch.Tensor:
    """NaN and Inf bit patterns: what unwritten or recycled cache rows may hold."""
    if dtype == torch.bfloat16:
        return (torch.randint(0, 128, shape, generator=gen, dtype=torch.int16) | 0x7F80).view(torch.bfloat16)
    return (torch.randint(0, 1 << 22, shape, generator=gen, dtype=torch.int32) | 0x7F800000).view(torch.float32)


def make_rows(contexts, heads, kv_heads, dim, dv, dtype, latent=False, seed=0):
    """q ``[B, heads, dim]`` (rows of a wider buffer, as a fused qkv projection lays them out), caches with
    random rows ``[slot, :ctx]`` and garbage elsewhere, shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    num_slots, max_len = len(contexts) + 2, max(contexts) + 8
    k_cache = garbage((num_slots, max_len, kv_heads, dim), dtype, gen)
    v_cache = k_cache[..., :dv] if latent else garbage((num_slots, max_len, kv_heads, dv), dtype, gen)
    slots = torch.randperm(num_slots, generator=gen)[: len(contexts)]
    for slot, ctx in zip(slots.tolist(), contexts, strict=True):
        k_cache[slot, :ctx] = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype)
        if not latent:
            v_cache[slot, :ctx] = torch.randn(ctx, kv_heads, dv, generator=gen).to(dtype)
    buf = torch.randn(len(contexts), (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = buf[:, : heads * dim].view(len(contexts), heads, dim)
    return q, k_cache, v_cache, slots, torch.tensor(contexts)


def oracle(q, k_cache, v_cache, slots, contexts, scale) -> torch.Tensor:
    """float64 softmax(q K^T * scale) V per row over its context, GQA by repeating the KV heads."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape[0], heads, v_cache.shape[-1], dtype=torch.float64)
    for b, (slot, ctx) in enumerate(zip(slots.tolist(), contexts.tolist(), strict=True)):
        k = k_cache[slot, :ctx].double().repeat_interleave(heads // kv_heads, dim=1)  # [ctx, H, D]
        v = v_cache[slot, :ctx].double().repeat_interleave(heads // kv_heads, dim=1)
        w = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), k) * scale, dim=-1)
        out[b] = torch.einsum("ht,thd->hd", w, v)
    return out


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs()
    if out.dtype == torch.float32:
        assert (err <= 1e-5 + 1e-4 * ref.abs()).all(), f"max error {err.max():.3g}"
    else:  # fp32 products, softmax and sums, then one rounding to bf16 (at most half an ulp, 2^-9 relative)
        assert (err <= 1e-4 + 2.0**-8 * ref.abs()).all(), f"max error {err.max():.3g}"


def varlen_rows(q, k_cache, v_cache, slots, contexts, scale) -> torch.Tensor:
    n = q.shape[0]
    out = _native_prefill_attention(q, k_cache, v_cache, slots.tolist(), list(range(n + 1)), contexts.tolist(), scale)
    assert out is not None, "the native kernel should apply"
    return out


# (heads, kv heads, head dim, value dim, latent): G = 3 (SmolLM2), 1, 8, 16, 6 (queries padded to 8 in the
# tiles), head dims of 2, 3 and 4 AMX steps, a latent cache with 32 value channels, value widths that are
# not multiples of 32 (the AVX-512 path)
SHAPES = [(9, 3, 64, 64, False), (4, 4, 64, 64, False), (16, 2, 128, 128, False), (16, 1, 64, 64, False),
          (12, 2, 96, 96, False), (8, 1, 64, 32, True), (6, 2, 64, 48, False)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim,dv,latent", SHAPES)
def test_decode_rows_match_the_oracle_and_do_not_depend_on_the_batch(dtype, heads, kv_heads, dim, dv, latent):
    q, k_cache, v_cache, slots, contexts = make_rows(CONTEXTS, heads, kv_heads, dim, dv, dtype, latent, seed=dim)
    scale = dim**-0.5
    batched = varlen_rows(q, k_cache, v_cache, slots, contexts, scale)  # 16 rows: whole-row items
    assert_matches(batched, oracle(q, k_cache, v_cache, slots, contexts, scale))
    for rows in ([0, 6, 15], [13], [14, 15]):  # few rows: one item per KV head, the same arithmetic
        idx = torch.tensor(rows)
        few = varlen_rows(q[idx], k_cache, v_cache, slots[idx], contexts[idx], scale)
        assert torch.equal(few, batched[idx]), rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_stores_the_new_rows_then_attends(dtype):
    heads, kv_heads, dim = 9, 3, 64
    q, k_cache, v_cache, slots, contexts = make_rows(CONTEXTS, heads, kv_heads, dim, dim, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    k_new = torch.randn(len(CONTEXTS), kv_heads, dim, generator=gen).to(dtype)
    v_new = torch.randn(len(CONTEXTS), kv_heads, dim, generator=gen).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref[slots, contexts - 1] = k_new
    v_ref[slots, contexts - 1] = v_new
    out = decode_attention(q.contiguous(), k_cache, v_cache, slots, contexts, 0.125, k_new, v_new)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(k_cache.view(bits), k_ref.view(bits)) and torch.equal(v_cache.view(bits), v_ref.view(bits))
    assert_matches(out, oracle(q, k_ref, v_ref, slots, contexts, 0.125))
    few = decode_attention(q[:3].contiguous(), k_cache, v_cache, slots[:3], contexts[:3], 0.125)
    assert torch.equal(few, out[:3])


def test_softmax_is_shift_invariant_for_peaked_scores():
    """Scores far apart (one key dominates, others underflow) and a maximum that moves late in the context:
    the running max must be subtracted exactly, or exp overflows / the rescale of earlier blocks goes wrong."""
    heads, kv_heads, dim = 9, 3, 64
    q, k_cache, v_cache, slots, contexts = make_rows(CONTEXTS, heads, kv_heads, dim, dim, torch.bfloat16, seed=3)
    q = (q * 24).to(torch.bfloat16)  # scores of several hundred: exp(s) alone would overflow fp32
    out = varlen_rows(q, k_cache, v_cache, slots, contexts, 1.0)
    assert_matches(out, oracle(q, k_cache, v_cache, slots, contexts, 1.0))
