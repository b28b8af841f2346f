"""The native C kernels against torch references (skipped only where they cannot build)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from xllm.kernels import decode_attention, linear, native
from xllm.kernels.attention import _attend_decode

needs_native = pytest.mark.skipif(native.unavailable_reason() is not None,
                                  reason=f"native kernels unavailable: {native.unavailable_reason()}")


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the bf16 spacing at b's magnitude."""
    spacing = torch.ldexp(torch.ones_like(b.float()), torch.frexp(b.float()).exponent - 8)
    return ((a.float() - b.float()).abs() / spacing).max().item()


@needs_native
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_native_gemm_fp32_matches_torch(m, bias):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 96, generator=g), torch.randn(130, 96, generator=g)
    b = torch.randn(130, generator=g) if bias else None
    got = linear(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_native_gemm_bf16_is_the_rounded_exact_product(m, bias):
    g = torch.Generator().manual_seed(10 + m)
    x = torch.randn(m, 128, generator=g).bfloat16()
    w = torch.randn(70, 128, generator=g).bfloat16()
    b = torch.randn(70, generator=g).bfloat16() if bias else None
    got = linear(x, w, b)
    assert got.dtype == torch.bfloat16
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert bf16_ulps(got, exact.float().bfloat16()) <= 1.0  # fp32 accumulation, one rounding
    logits = linear(x, w, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4)


def test_linear_falls_back_outside_the_native_shapes():
    x, w = torch.randn(9, 48), torch.randn(20, 48)  # 9 rows and K % 16 != 0: torch path
    torch.testing.assert_close(linear(x, w), F.linear(x, w))


def cache_case(dtype, dim=64, dv=None, kv_heads=2, heads=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots_total, max_len = 5, 40
    k = torch.randn(slots_total, max_len, kv_heads, dim, generator=g).to(dtype)
    if dv is None:
        v = torch.randn(slots_total, max_len, kv_heads, dim, generator=g).to(dtype)
    else:
        v = k[..., :dv]  # latent cache: values are the first dv channels of the keys
    k[:, 30:] = float("nan")  # never read: past every length below
    slots = torch.tensor([3, 0, 4])
    lens = torch.tensor([7, 30, 1])
    q = torch.randn(3, heads, dim, generator=g).to(dtype)
    return q, k, v, slots, lens


@needs_native
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("latent", [False, True])
def test_native_decode_attention_reads_kv_in_place(dtype, tol, latent):
    if latent:
        q, k, v, slots, lens = cache_case(dtype, dim=80, dv=64, kv_heads=1, heads=4)
    else:
        q, k, v, slots, lens = cache_case(dtype)
    got = decode_attention(q, k, v, slots, lens, 0.125)
    ref = _attend_decode(q.float(), k[slots, :30].float().clone(), v[slots, :30].float().clone(), lens, 0.125)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


def test_native_kernels_can_be_disabled():
    code = ("import torch; from xllm.kernels import native, linear; assert native.library() is None; "
            "x, w = torch.randn(1, 64), torch.randn(8, 64); "
            "torch.testing.assert_close(linear(x, w), torch.nn.functional.linear(x, w)); print('ok')")
    env = {**os.environ, "XLLM_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


@needs_native
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1001])
def test_native_argmax_matches_torch_including_ties(vocab):
    """The C kernel itself (not ``argmax_rows``, which falls back to torch where the kernel cannot
    run): ties resolve to the first index, as in torch, across vector-width boundaries."""
    from xllm.kernels.sampling import argmax_rows

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    if vocab > 1:
        x[1, 0] = x[1, vocab - 1] = 50.0           # first and last
        x[2, vocab // 2] = x[2, vocab - 1] = 50.0  # middle and last (often another vector lane)
        x[3] = 7.0                                 # all equal: index 0
        x[4, vocab - 1] = 60.0                     # the maximum in the tail
        x[5, :] = float("-inf")
        x[5, vocab - 1] = -1e30
    lib = native.for_tensors(x)
    assert lib is not None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.lib.xllm_argmax_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    assert out.tolist() == x.argmax(-1).tolist()
    assert argmax_rows(x).tolist() == out.tolist()  # the wrapper takes the kernel here
