"""The greedy LM head (kernels/cpu/lm_head.c): the row argmax of the logits the head's product writes, without
writing them, against the argmax of those logits: the packed bf16/fp32 GEMM (AMX and AVX-512 paths through
their row counts) and every quantized format through xq_linear_team's paths, over vocabularies spanning
several chunks of both threads, with exact ties placed across lanes, panels, chunks and threads."""

from __future__ import annotations

import pytest
import torch

from xllm.kernels import gemm, gemm_choice, native, quant, quant_native
from xllm.kernels.gemm_choice import GemmChoice
from xllm.kernels.linear import linear, linear_argmax, pack_weight
from xllm.kernels.sampling import argmax_rows

needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable")

# a vocabulary of several 1 MB chunks per thread at 64 rows (a chunk: 170 panels of bf16 logits at 64 rows)
N_BIG = 20011


def _tied(w: torch.Tensor, pairs: list[tuple[int, int]], boost: float = 4.0) -> torch.Tensor:
    """``w`` with row ``b`` a copy of row ``a`` for each pair, both scaled up: those columns tie exactly and
    are likely the rows' maxima, so the argmax must pick the lower of each pair."""
    w = w.clone()
    for a, b in pairs:
        w[a] *= boost
        w[b] = w[a]
    return w


# ties inside a lane (16 apart), across panels (48), across a chunk boundary and across the two threads
PAIRS = [(5, 21), (100, 148), (8100, 8200), (9000, N_BIG - 3)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@needs_native
def test_packed_argmax_is_the_logits_argmax(dtype):
    gen = torch.Generator().manual_seed(3)
    k = 64
    w = _tied(torch.randn(N_BIG, k, generator=gen) * 0.2, PAIRS).to(dtype)
    b = torch.randn(N_BIG, generator=gen).to(dtype)
    pw = gemm.pack(w)
    for m in (1, 2, 5, 16, 17, 64, 130):
        a, _ = PAIRS[m % len(PAIRS)]
        x = torch.randn(m, k, generator=gen).to(dtype)
        x[0] = w[a].float() / w[a].float().norm()  # row 0's maximum: the tie of columns a and b
        for bias in (None, b):
            logits = gemm.packed_linear(x, pw, bias, widen=dtype == torch.bfloat16)
            want = argmax_rows(logits.float())
            got = gemm.packed_argmax(x, pw, bias)
            assert got.dtype == torch.int64 and torch.equal(got, want), (m, dtype, bias is None)
            assert bias is not None or int(got[0]) == a  # the lower column of the tie


@needs_native
def test_linear_argmax_follows_linear_routing():
    """linear_argmax equals the argmax of the logits of the route it takes: linear(..., widen=True)'s on the
    skinny GEMV (one row), the packed GEMM (2-8 rows, and more with no oneDNN copy) and oneDNN (more rows
    with a copy, the choice for oneDNN beyond GREEDY_SLACK); the native packed logits' where the choice
    credits the native kernel with the logits it does not write."""
    gen = torch.Generator().manual_seed(5)
    w = _tied(torch.randn(3001, 64, generator=gen) * 0.2, [(7, 2000)]).to(torch.bfloat16)
    pw = gemm.pack(w)
    od = pack_weight(w)
    onednn, close = gemm_choice.forced(False), GemmChoice(gemm_choice.BUCKETS, (False,) * len(gemm_choice.BUCKETS),
                                                        (1.3,) * len(gemm_choice.BUCKETS))
    for m, kw, native_logits in [(1, {}, False), (1, {"native_packed": pw}, False), (4, {"native_packed": pw}, True),
                                 (40, {"native_packed": pw}, True), (40, {"native_packed": pw, "packed": od}, True),
                                 (40, {"native_packed": pw, "packed": od, "choice": onednn}, False),
                                 (40, {"native_packed": pw, "packed": od, "choice": close}, True), (40, {}, False)]:
        x = torch.randn(m, 64, generator=gen).to(torch.bfloat16)
        logits = gemm.packed_linear(x, pw, widen=True) if native_logits else linear(x, w, widen=True, **kw)
        assert torch.equal(linear_argmax(x, w, **kw), argmax_rows(logits)), (m, sorted(kw))


@pytest.mark.skipif(quant_native.library() is None, reason="native quantized kernels unavailable")
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_quant_argmax_is_the_logits_argmax(fmt):
    gen = torch.Generator().manual_seed(11)
    k = 128
    w = _tied(torch.randn(N_BIG, k, generator=gen) * 0.05, PAIRS)
    qw = quant.quantize(w, fmt)
    b = torch.randn(N_BIG, generator=gen)
    for m in (1, 7, 20, 64):
        for dtype in (torch.bfloat16, torch.float32):
            a, _ = PAIRS[m % len(PAIRS)]
            x = torch.randn(m, k, generator=gen)
            x[0] = w[a] / w[a].norm()  # row 0's maximum: the tie of columns a and b (the same quantized rows)
            x = x.to(dtype)
            for bias in (None, b.to(dtype)):
                want = argmax_rows(quant.quant_linear(x, qw, bias).float())
                got = quant.quant_argmax(x, qw, bias)
                assert torch.equal(got, want), (fmt, m, dtype, bias is None)
                assert bias is not None or int(got[0]) == a
