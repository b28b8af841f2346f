"""The AVX2 library's GEMMs (kernels/cpu/avx2/gemm_avx2.c), which run every bf16 product and the decode-sized
fp32 ones of :func:`xllm.kernels.linear.linear` on CPUs without the AVX-512 library; tested on any CPU with
AVX2 (called directly where the AVX-512 library is what linear takes). The oracle is torch's fp32 product of
the same values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xllm.kernels import native
from xllm.kernels.linear import AVX2_F32_MIN, MAX_NATIVE_ROWS, linear, pack_weight

pytestmark = pytest.mark.skipif(native.avx2_unavailable_reason() is not None,
                                reason=f"no AVX2 library here ({native.avx2_unavailable_reason()})")

SHAPES = [(1, 576, 37), (2, 8, 3), (3, 100, 64), (4, 576, 1), (5, 1536, 33), (9, 100, 37), (64, 64, 96)]


def gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, mode: int = 0) -> torch.Tensor:
    """The C entry points themselves: fp32 operands, or bf16 ones with mode 0 fp32, 1 bf16, 2 bf16-rounded fp32."""
    lib, bias = native.avx2_library().lib, None if b is None else b.data_ptr()
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16 if mode == 1 else torch.float32)
    if x.dtype == torch.float32:
        lib.xllm_gemm_f32(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0], bias, y.data_ptr())
    else:
        lib.xllm_gemm_bf16(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0], bias, y.data_ptr(), mode)
    return y


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_the_product_is_the_fp32_product_of_the_bf16_values(m, k, n, with_bias):
    """Any rows, a K with a tail of under 8 values (100), one output column; each output format."""
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    y32 = gemm(x, w, b, 0)
    assert float((y32 - ref).abs().max()) <= 1e-5 * max(1.0, float(ref.abs().max())), (m, k, n)  # summation order
    y16 = gemm(x, w, b, 1)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y32.bfloat16())  # nearest even, as torch rounds
    assert torch.equal(gemm(x, w, b, 2), y16.float())
    x32, w32, b32 = x.float() * 1.001, w.float() * 0.999, None if b is None else b.float()
    ref32 = F.linear(x32.double(), w32.double(), None if b32 is None else b32.double()).float()
    assert float((gemm(x32, w32, b32) - ref32).abs().max()) <= 1e-5 * max(1.0, float(ref32.abs().max()))


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Tiles of 4 rows by 2 columns, 1 by 4 for one row, the edges 1 by 1: every row alone equals its row in
    the batch bit for bit (batched decode gives each request what it gets alone)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(11, 136, generator=gen).bfloat16()
    w = torch.randn(71, 136, generator=gen).bfloat16()
    batch = gemm(x, w, None, 0)
    for i in range(x.shape[0]):
        assert torch.equal(gemm(x[i:i + 1].contiguous(), w, None, 0)[0], batch[i]), i
    assert torch.equal(gemm(x[3:9].contiguous(), w, None, 0), batch[3:9])


@pytest.mark.skipif(native.library() is not None, reason="the AVX-512 library runs bf16 products here")
def test_linear_takes_it_for_bf16_products_and_fp32_decode_rows_on_this_cpu():
    """Without the AVX-512 library, linear runs bf16 on the AVX2 GEMM at any row count and with any leading
    dims (decode, prefill, widened logits), keeps no oneDNN copy of bf16 weights it would never read, and runs
    fp32 decode rows on the AVX2 GEMV."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=gen).bfloat16()
    b = torch.randn(40, generator=gen).bfloat16()
    for m in (1, 8, 30):
        x = torch.randn(m, 96, generator=gen).bfloat16()
        assert torch.equal(linear(x, w, b), gemm(x, w, b, 1))
        assert torch.equal(linear(x, w, b, out_dtype=torch.float32), gemm(x, w, b, 0))
        assert torch.equal(linear(x, w, b, widen=True), gemm(x, w, b, 1).float())
    x3 = torch.randn(2, 5, 96, generator=gen).bfloat16()
    assert torch.equal(linear(x3, w), gemm(x3.reshape(10, 96), w, None, 1).reshape(2, 5, 40))
    assert pack_weight(w) is None
    w32 = torch.randn(AVX2_F32_MIN // 64, 64, generator=gen)
    for m in (1, MAX_NATIVE_ROWS):  # fp32: the decode rows of a weight that is not tiny
        x = torch.randn(m, 64, generator=gen)
        assert torch.equal(linear(x, w32), gemm(x, w32, None))
    assert pack_weight(w.float()) is not None or not torch.backends.mkldnn.is_available()
