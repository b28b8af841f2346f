"""The native varlen prefill attention and KV row write against independent torch references.

The reference attends each sequence on its own in fp32 (float64 for the softmax) with an explicit
causal mask over the whole prefix. Every cache row past a sequence's context holds NaN/Inf bit
patterns, so a kernel that reads stale rows (or lets masked garbage into the sum) fails.
"""

from __future__ import annotations

import pytest
import torch

from xllm.kernels import native
from xllm.kernels.attention import _native_prefill_attention, prefill_attention, write_kv_rows

needs_native = pytest.mark.skipif(native.unavailable_reason() is not None,
                                  reason=f"native kernels unavailable: {native.unavailable_reason()}")

MAX_LEN = 1040


def garbage_like(shape, dtype, gen) -> torch.Tensor:
    """NaN and Inf bit patterns (random payloads): what unwritten or recycled cache rows may hold."""
    if dtype == torch.bfloat16:
        bits = torch.randint(0, 128, shape, generator=gen, dtype=torch.int16) | 0x7F80
        return bits.view(torch.bfloat16)
    bits = torch.randint(0, 1 << 22, shape, generator=gen, dtype=torch.int32) | 0x7F800000
    return bits.view(torch.float32)


def make_batch(seqs, heads, kv_heads, dim, dv, dtype, latent=False, q_pad=0, seed=0):
    """Caches (garbage past every context), slots, starts, contexts and a row-strided ``q``.

    ``seqs`` is a list of (chunk rows n, context ctx); ``q_pad`` extra channels per q row mimic
    the q part of a fused qkv buffer."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = len(seqs) + 2
    width = dim
    k_cache = garbage_like((num_slots, MAX_LEN, kv_heads, width), dtype, gen)
    v_cache = k_cache[..., :dv] if latent else garbage_like((num_slots, MAX_LEN, kv_heads, dv), dtype, gen)
    slots = torch.randperm(num_slots, generator=gen)[: len(seqs)].tolist()
    for slot, (_, ctx) in zip(slots, seqs, strict=True):
        k_cache[slot, :ctx] = torch.randn(ctx, kv_heads, width, generator=gen).to(dtype)
        if not latent:
            v_cache[slot, :ctx] = torch.randn(ctx, kv_heads, dv, generator=gen).to(dtype)
    starts = [0]
    for n, _ in seqs:
        starts.append(starts[-1] + n)
    buf = torch.randn(starts[-1], heads * dim + q_pad, generator=gen).to(dtype)
    q = buf[:, :heads * dim].view(starts[-1], heads, dim)
    return q, k_cache, v_cache, slots, starts, [c for _, c in seqs]


def reference(q, k_cache, v_cache, slots, starts, ctxs, scale) -> torch.Tensor:
    """Per sequence: fp64 softmax(Q K^T * scale + causal mask over the prefix) V, GQA by repeat."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape[0], heads, v_cache.shape[-1], dtype=torch.float64)
    for i, slot in enumerate(slots):
        a, b, ctx = starts[i], starts[i + 1], ctxs[i]
        n = b - a
        qi = q[a:b].double().transpose(0, 1)                                   # [H, n, D]
        k = k_cache[slot, :ctx].double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = v_cache[slot, :ctx].double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        pos = torch.arange(n).unsqueeze(1) + (ctx - n)
        mask = torch.arange(ctx).unsqueeze(0) <= pos                            # [n, ctx]
        s = (qi @ k.transpose(1, 2)) * scale
        s = s.masked_fill(~mask, float("-inf"))
        out[a:b] = (torch.softmax(s, dim=-1) @ v).transpose(0, 1)
    return out


def check(seqs, heads, kv_heads, dim, dv, dtype, latent=False, q_pad=0, seed=0):
    q, k_cache, v_cache, slots, starts, ctxs = make_batch(seqs, heads, kv_heads, dim, dv, dtype, latent, q_pad, seed)
    scale = dim**-0.5
    out = _native_prefill_attention(q, k_cache, v_cache, slots, starts, ctxs, scale)
    assert out is not None, "the native kernel should apply"
    ref = reference(q, k_cache, v_cache, slots, starts, ctxs, scale)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    else:  # products and sums are fp32; the output is rounded to bf16 (2^-9 relative)
        torch.testing.assert_close(out.double(), ref, atol=4e-3, rtol=8e-3)
        assert (out.double() - ref).abs().mean() < 1e-3
    # the public entry takes the same path (and accepts tensors for the index lists)
    again = prefill_attention(q, k_cache, v_cache, torch.tensor(slots), torch.tensor(starts), torch.tensor(ctxs), scale)
    assert torch.equal(again, out)


# (chunk rows, context): decode rows, fresh prompts, chunks after a cached prefix, lengths that
# are not multiples of the 32-key tiles or of the row blocks.
MIX = [(1, 37), (133, 133), (70, 1000), (1, 1), (2, 9), (31, 31), (1, 513), (17, 300)]


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
def test_varlen_matches_reference_gqa(dtype, heads, kv_heads):
    check(MIX, heads, kv_heads, 64, 64, dtype, q_pad=2 * kv_heads * 64)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [128, 48, 96, 33])
def test_varlen_matches_reference_head_dims(dtype, dim):
    check([(1, 20), (45, 45), (40, 160), (3, 3)], 6, 2, dim, dim, dtype, seed=dim)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,dim,dv", [(8, 80, 64), (16, 576, 512)])
def test_varlen_latent_cache_values_in_keys(dtype, heads, dim, dv):
    # MLA-style: one KV head whose values are the first Dv channels of the keys
    check([(1, 50), (37, 90), (20, 20)], heads, 1, dim, dv, dtype, latent=True, seed=3)


@needs_native
def test_varlen_only_decode_rows_and_single_long_chunk():
    check([(1, c) for c in (1, 2, 17, 64, 999)], 9, 3, 64, 64, torch.bfloat16, seed=4)
    check([(512, 512)], 9, 3, 64, 64, torch.bfloat16, seed=5)


def test_unpacked_heads_fall_back_to_torch():
    seqs = [(5, 12), (1, 7), (9, 9)]
    q, k_cache, v_cache, slots, starts, ctxs = make_batch(seqs, 4, 2, 16, 16, torch.float32)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # heads not packed within a row
    assert _native_prefill_attention(q_t, k_cache, v_cache, slots, starts, ctxs, 0.25) is None
    out = prefill_attention(q_t, k_cache, v_cache, slots, starts, ctxs, 0.25)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, slots, starts, ctxs, 0.25),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("latent", [False, True])
def test_write_kv_rows_matches_index_put(dtype, latent):
    gen = torch.Generator().manual_seed(7)
    kv_heads, dim = 3, 64
    t = 50
    qkv = torch.randn(t, (3 + 2 * kv_heads) * dim, generator=gen).to(dtype)  # rows of a fused projection
    k = qkv[:, 3 * dim:(3 + kv_heads) * dim].view(t, kv_heads, dim)
    v = None if latent else qkv[:, (3 + kv_heads) * dim:].view(t, kv_heads, dim)
    slots = torch.randint(0, 4, (t,), generator=gen)
    positions = torch.randperm(200, generator=gen)[:t]
    k_cache = garbage_like((4, 200, kv_heads, dim), dtype, gen)
    v_cache = None if latent else garbage_like((4, 200, kv_heads, dim), dtype, gen)
    k_ref = k_cache.clone()
    v_ref = None if latent else v_cache.clone()
    k_ref[slots, positions] = k
    if not latent:
        v_ref[slots, positions] = v
    write_kv_rows(k_cache, v_cache, slots, positions, k, v)
    # bitwise (the garbage is NaN, so compare bits, not values)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(k_cache.view(bits), k_ref.view(bits))
    if not latent:
        assert torch.equal(v_cache.view(bits), v_ref.view(bits))


@needs_native
def test_rows_do_not_depend_on_the_batch_or_the_chunking():
    """A row's output is bitwise the same alone, batched with other sequences, or with its chunk
    split differently (as long as its chunk has more than one row): work items never mix rows."""
    seqs = [(300, 300), (1, 40), (77, 500), (5, 5)]
    q, k_cache, v_cache, slots, starts, ctxs = make_batch(seqs, 9, 3, 64, 64, torch.bfloat16, seed=11)
    scale = 0.125
    batched = _native_prefill_attention(q, k_cache, v_cache, slots, starts, ctxs, scale)
    alone = _native_prefill_attention(q[:300], k_cache, v_cache, slots[:1], [0, 300], [300], scale)
    assert torch.equal(batched[:300], alone)
    # sequence 0's last 300 rows as chunks of 100 + 133 + 67 rows: row t of a chunk ending at context c
    split = [(0, 100, 100), (100, 233, 233), (233, 300, 300)]
    for a, b, ctx in split:
        part = _native_prefill_attention(q[a:b], k_cache, v_cache, slots[:1], [0, b - a], [ctx], scale)
        assert torch.equal(part, batched[a:b])
