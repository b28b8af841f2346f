"""Quantized KV rows (xllm.kernels.kv_quant) and attention over them (xllm.kernels.attention_quant):
encoding against an independent per-element oracle, the native kernels against the torch path,
and quantized attention against attention over the unquantized K/V."""

from __future__ import annotations

import pytest
import torch

from xllm.kernels import decode_attention, native, prefill_attention
from xllm.kernels.attention_quant import (
    decode_attention_q,
    paged_decode_attention_q,
    paged_prefill_attention_q,
    paged_write_kv_q,
    prefill_attention_q,
    write_kv_rows_q,
)
from xllm.kernels.kv_quant import KVQuantFormat, decode_rows, encode_rows, row_bytes

needs_native = pytest.mark.skipif(native.library() is None, reason=native.unavailable_reason() or "no native lib")
KINDS = ("int8", "fp8_e4m3")
KVH, D, H = 2, 64, 6


def fmt(kind: str, align: int = 1, heads: int = KVH, dim: int = D) -> KVQuantFormat:
    return KVQuantFormat(kind, heads, dim, row_bytes(heads, dim, align))


@pytest.mark.parametrize("kind", KINDS)
def test_rows_roundtrip_against_elementwise_oracle(kind):
    f = fmt(kind, align=64)
    x = torch.randn(7, KVH, D, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 2, 7)[:, None, None]
    x[3, 1] = 0.0  # an all-zero head: scale 0, codes 0
    rows = encode_rows(x, f)
    assert rows.shape == (7, f.row_bytes) and f.row_bytes % 64 == 0 and not rows[:, f.packed_bytes:].any()
    back = decode_rows(rows, f)
    for t in range(7):
        for g in range(KVH):
            piece = rows[t, g * (D + 4):(g + 1) * (D + 4)]
            scale = piece[D:].view(torch.float32).item()
            amax = x[t, g].abs().max().item()
            assert scale == pytest.approx(amax / f.qmax, rel=1e-6)
            codes = piece[:D].view(f.code_dtype).float()
            assert torch.equal(back[t, g], codes * scale)
            # error bound of the codes: half a step of int8, 2^-4 relative for e4m3 (3 mantissa bits)
            err = (back[t, g] - x[t, g]).abs()
            bound = scale * 0.5 + 1e-12 if kind == "int8" else x[t, g].abs() * 2 ** -4 + scale * 2 ** -9 + 1e-12
            assert (err <= bound * 1.0001).all()
    assert not back[3, 1].any()


def _rows(kind, dtype, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, KVH, D, generator=g) * 3).to(dtype)


@needs_native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_native_encoding_is_bit_identical(kind, dtype):
    f = fmt(kind, align=16)
    k, v = _rows(kind, dtype), _rows(kind, dtype, seed=1)
    k[5] = 0.0
    k[6, 0, :4] = torch.tensor([1e-30, -1e-6, 448.0, -3.0])  # tiny values: fp8 subnormals / zeros
    slots = torch.zeros(40, dtype=torch.int64)
    pos = torch.randperm(40)
    kc = torch.full((1, 48, f.row_bytes), 0xAB, dtype=torch.uint8)
    vc = kc.clone()
    write_kv_rows_q(kc, vc, slots, pos, k, v, f, f)
    n = f.packed_bytes  # the padding is never written (nor read)
    assert torch.equal(kc[0, pos, :n], encode_rows(k, f)[:, :n])
    assert torch.equal(vc[0, pos, :n], encode_rows(v, f)[:, :n])


def _caches(kind, dtype, slots=3, max_len=80, dim=D):
    f = fmt(kind, align=16, dim=dim)
    g = torch.Generator().manual_seed(2)
    kx = torch.randn(slots, max_len, KVH, dim, generator=g).to(dtype)
    vx = torch.randn(slots, max_len, KVH, dim, generator=g).to(dtype)
    return f, kx, vx, encode_rows(kx, f), encode_rows(vx, f)


# head width 64: bf16 queries score with vdpbf16ps; 48: the fp32 score path of bf16 models
CASES = [(kind, dtype, D) for kind in KINDS for dtype in (torch.bfloat16, torch.float32)] + \
    [(kind, torch.bfloat16, 48) for kind in KINDS]


@pytest.mark.parametrize(("kind", "dtype", "dim"), CASES)
def test_decode_native_matches_torch_and_unquantized(kind, dtype, dim, monkeypatch):
    f, kx, vx, kc, vc = _caches(kind, dtype, dim=dim)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, H, dim, generator=g).to(dtype)
    slots = torch.tensor([2, 0, 1])
    lens = torch.tensor([77, 1, 33])
    k_new, v_new = (torch.randn(3, KVH, dim, generator=g).to(dtype) for _ in range(2))
    kc2, vc2 = kc.clone(), vc.clone()
    out = decode_attention_q(q, kc, vc, slots, lens, 0.125, f, f, k_new, v_new)
    monkeypatch.setattr(native, "library", lambda: None)
    ref = decode_attention_q(q, kc2, vc2, slots, lens, 0.125, f, f, k_new, v_new)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the new rows stored identically
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # against attention over the unquantized rows (quantization error only)
    kx[slots, lens - 1], vx[slots, lens - 1] = k_new, v_new
    exact = decode_attention(q.float(), kx.float(), vx.float(), slots, lens, 0.125)
    torch.testing.assert_close(ref.float(), exact, atol=quant_tol(kind, vx), rtol=0)


def quant_tol(kind: str, v: torch.Tensor) -> float:
    """Attention output error from quantizing K/V: an output is a convex combination of values, each off by at
    most half a code step (int8: amax / 254; e4m3, 3 mantissa bits: 2^-4 of the value), plus what the keys'
    error does to the probabilities (small here: unit-variance scores scaled by 1/8)."""
    amax = v.abs().max().item()
    return amax / 254 + 0.01 if kind == "int8" else amax * 2 ** -4 + 0.02


@pytest.mark.parametrize(("kind", "dtype", "dim"), CASES)
def test_varlen_native_matches_torch_and_unquantized(kind, dtype, dim, monkeypatch):
    f, kx, vx, kc, vc = _caches(kind, dtype, dim=dim)
    # chunks: a 40-row prompt over a 30-token cached prefix, a decode row, a fresh 9-row prompt
    slots, starts, ctx = [1, 0, 2], [0, 40, 41, 50], [70, 12, 9]
    q = torch.randn(50, H, dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = prefill_attention_q(q, kc, vc, slots, starts, ctx, 0.125, f, f)
    monkeypatch.setattr(native, "library", lambda: None)
    ref = prefill_attention_q(q, kc, vc, slots, starts, ctx, 0.125, f, f)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    exact = prefill_attention(q.float(), kx.float(), vx.float(), slots, starts, ctx, 0.125)
    torch.testing.assert_close(ref.float(), exact, atol=quant_tol(kind, vx), rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_paged_matches_slot_layout(kind):
    """Paged pools hold the same rows as slot caches: the same attention results."""
    f, kx, vx, kc, vc = _caches(kind, torch.float32, slots=1, max_len=64)
    bs = 16
    perm = torch.tensor([3, 0, 2, 1])  # logical block i lives in page perm[i]
    kp = torch.zeros(4, bs, f.row_bytes, dtype=torch.uint8)
    vp = kp.clone()
    mapping = (perm[:, None] * bs + torch.arange(bs)).flatten()
    paged_write_kv_q(kp, vp, kx[0], vx[0], mapping, f, f)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, H, D, generator=g)
    lens = torch.tensor([50])
    out = paged_decode_attention_q(q, kp, vp, perm[None], lens, 0.1, f, f)
    ref = decode_attention_q(q, kc, vc, torch.tensor([0]), lens, 0.1, f, f)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    qp = torch.randn(5, H, D, generator=g)
    out = paged_prefill_attention_q(qp, kp, vp, [perm], [0, 5], [50], 0.1, f, f)
    ref = prefill_attention_q(qp, kc, vc, [0], [0, 5], [50], 0.1, f, f)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
