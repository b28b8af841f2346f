"""Linear layers: a native skinny GEMM for decode-sized inputs, and for larger ones whichever of the
native packed GEMM and oneDNN measured faster for the shape (:mod:`xllm.kernels.gemm_choice`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xllm.kernels import native
from xllm.kernels.gemm import PackedWeight, packed_argmax, packed_linear
from xllm.kernels.gemm_choice import GemmChoice
from xllm.kernels.sampling import argmax_rows

MAX_NATIVE_ROWS = 8
#: the smallest fp32 weight the AVX2 library's GEMV takes (elements): below it torch's call is cheaper than the
#: kernel's (a 64 x 128 product: ~7 against ~30 us, this session's Zen 3; from 64 x 1024 the kernel is ahead)
AVX2_F32_MIN = 65536


def native_linear_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` would take the native path for these operands."""
    if x.dim() != 2 or x.shape[0] > MAX_NATIVE_ROWS or x.device.type != "cpu" or x.dtype != weight.dtype:
        return False
    if x.dtype not in (torch.bfloat16, torch.float32) or not (x.is_contiguous() and weight.is_contiguous()):
        return False
    if x.shape[1] % (32 if x.dtype == torch.bfloat16 else 16):
        return False  # the kernel's vector loop has no tail
    return native.library() is not None


def pack_weight(weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor | None:
    """oneDNN's blocked copy of ``weight`` for large-batch GEMMs, or None where
    oneDNN packing is unavailable (non-CPU, no mkldnn build)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return None
    if weight.dtype == torch.bfloat16 and _avx2_only() is not None:
        return None  # (linear runs every bf16 product on the AVX2 library: the copy would never be read)
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    except (RuntimeError, AttributeError):
        return None


#: how much slower than oneDNN the native packed GEMM may measure and still take a ``widen`` product: it
#: writes the float32 logits itself, where oneDNN's bf16 output is then converted (SmolLM2's head at 64 rows:
#: the GEMM ~5 ms, the conversion ~1 ms, this Xeon, 2 threads)
WIDEN_SLACK = 1.2
#: the same for a greedy head's argmax (:func:`linear_argmax`): the native kernel writes nothing, where oneDNN's
#: bf16 logits are converted and read back by the argmax (SmolLM2's head at 64 rows, this session's AMX Xeon:
#: oneDNN 5.0 ms + conversion 1.15 + argmax 0.6 ms against the native product alone)
GREEDY_SLACK = 1.5


def _native_packed_ok(x: torch.Tensor, pw: PackedWeight | None, bias: torch.Tensor | None) -> bool:
    return (pw is not None and x.dim() == 2 and x.device.type == "cpu" and x.dtype == pw.dtype
            and x.shape[1] == pw.k and (bias is None or (bias.dtype == pw.dtype and bias.device.type == "cpu")))


def _takes_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None,
                  native_packed: PackedWeight | None, choice: GemmChoice | None, slack: float) -> bool:
    """Whether :func:`linear` runs this product on the native packed GEMM (its docstring has the rule; ``slack``:
    the choice's credit for the work the native kernel saves, ``GemmChoice.use_native``)."""
    if torch.compiler.is_compiling() or not _native_packed_ok(x, native_packed, bias):
        return False
    if 2 <= x.shape[0] <= MAX_NATIVE_ROWS:
        # 2-8 rows: the packed GEMM streams the weights once too, without the GEMV's per-row
        # reductions (the GEMV turns compute-bound from ~4 rows); the fused steps do the same
        return True
    if native_linear_ok(x, weight) and (bias is None or bias.is_contiguous()):
        return False  # the skinny GEMV
    return packed is None or choice is None or choice.use_native(x.shape[0], slack)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, packed: torch.Tensor | None = None,
           native_packed: PackedWeight | None = None, choice: GemmChoice | None = None,
           widen: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` (``[M, K] x [N, K]``).

    Up to 8 rows in bf16/fp32 on a CPU with AVX-512 BF16 run the native GEMV, which
    streams each weight row once for all rows (the memory-bound decode case), except
    that 2-8 rows take the native packed GEMM when ``native_packed`` is given (it
    stays at the memory bandwidth where the GEMV turns compute-bound, and it is what
    the fused native steps run for those rows). More rows take the native packed
    GEMM (``native_packed``, see :func:`xllm.kernels.gemm.pack`) when it is given
    and either ``choice`` says it measured faster than oneDNN at this row count or
    there is no oneDNN copy; else ``packed`` (see :func:`pack_weight`: oneDNN's
    blocked layout, no per-call weight reorder) when given, else ``F.linear``.
    ``out_dtype=torch.float32`` returns fp32 directly from a bf16 product; ``widen`` (no ``out_dtype``)
    returns ``linear(...).float()`` exactly, which the native packed GEMM writes in one pass (logits).
    Under ``torch.compile`` it is a plain ``F.linear`` (Inductor packs weights itself).
    """
    if widen and out_dtype is not None:
        raise ValueError("linear: widen returns float32 itself, without out_dtype")
    wide_bf16 = widen and x.dtype == torch.bfloat16  # the packed GEMM writes these widened itself
    if torch.compiler.is_compiling():
        y = F.linear(x, weight, bias)
        return _cast(y, out_dtype, widen)
    if _takes_packed(x, weight, bias, packed, native_packed, choice, WIDEN_SLACK if widen else 1.0):
        return packed_linear(x, native_packed, bias, out_dtype, widen=wide_bf16)
    avx2 = _avx2_gemm(x, weight, bias)
    if avx2 is not None:
        return _avx2_linear(avx2, x, weight, bias, out_dtype, widen)
    if not native_linear_ok(x, weight) or (bias is not None and not bias.is_contiguous()):
        if packed is not None and x.dim() == 2 and x.dtype == weight.dtype:
            y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        else:
            y = F.linear(x, weight, bias)
        return _cast(y, out_dtype, widen)
    lib = native.library().lib
    m, k = x.shape
    n = weight.shape[0]
    bias_ptr = None if bias is None else bias.data_ptr()
    if x.dtype == torch.bfloat16:
        fp32_out = out_dtype == torch.float32
        y = torch.empty(m, n, dtype=torch.float32 if fp32_out else torch.bfloat16)
        lib.xllm_gemm_bf16(x.data_ptr(), m, k, weight.data_ptr(), n, bias_ptr, y.data_ptr(), 0 if fp32_out else 1)
        return _cast(y, None, widen)
    y = torch.empty(m, n, dtype=torch.float32)
    lib.xllm_gemm_f32(x.data_ptr(), m, k, weight.data_ptr(), n, bias_ptr, y.data_ptr())
    return _cast(y, out_dtype, widen)


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  packed: torch.Tensor | None = None, native_packed: PackedWeight | None = None,
                  choice: GemmChoice | None = None) -> torch.Tensor:
    """The row argmax (int64 ``[M]``, first index on ties) of the logits ``linear(x, weight, bias, ...,
    widen=True)`` gives: a greedy LM head. Where :func:`linear` would run the native packed GEMM, and also
    where the measured choice has oneDNN ahead by less than :data:`GREEDY_SLACK` (the native kernel then
    saves more than the conversion it saves the logits), it runs the native argmax, which never writes the
    logits (:func:`xllm.kernels.gemm.packed_argmax`; exactly the native logits' argmax, which in that second
    case may differ from oneDNN's logits at a bf16 near-tie, as any two summation orders may); elsewhere it
    computes the logits and takes their argmax."""
    if _takes_packed(x, weight, bias, packed, native_packed, choice, GREEDY_SLACK):
        return packed_argmax(x, native_packed, bias)
    return argmax_rows(linear(x, weight, bias, packed=packed, native_packed=native_packed, choice=choice, widen=True))


def dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``, except on a CPU where only the AVX2 library runs: there the products
    :func:`linear` would give it (bf16 at any row count: torch's bf16 GEMM there is its reference loop).
    For products whose weights change per call (a MoE layer's experts), where ``linear``'s packed copies and
    the AVX-512 GEMV's rounding are not wanted."""
    lib = _avx2_gemm(x, weight, None) if x.dtype == torch.bfloat16 else None
    return F.linear(x, weight) if lib is None else _avx2_linear(lib, x, weight, None, None, False)


def _avx2_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> native.NativeLibrary | None:
    """The AVX2 library where it runs this product: a CPU without the AVX-512 library, contiguous CPU operands
    of one dtype, bf16 at any row count (torch's bf16 GEMM there is its reference loop) or fp32 at up to
    :data:`MAX_NATIVE_ROWS` rows of a weight of :data:`AVX2_F32_MIN` elements or more (the decode GEMV, as the
    AVX-512 library runs it); else None."""
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu":
        return None
    if x.dim() < 1 or not (weight.is_contiguous() and weight.dim() == 2) or x.shape[-1] != weight.shape[1]:
        return None
    if x.dtype == torch.float32 and (x.dim() != 2 or x.shape[0] > MAX_NATIVE_ROWS or weight.numel() < AVX2_F32_MIN):
        return None
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        return None
    return _avx2_only()


def _avx2_only() -> native.NativeLibrary | None:
    """The AVX2 library where it is the only one (a CPU without the AVX-512 library), else None."""
    return native.avx2_library() if native.library() is None else None


def _avx2_linear(lib: native.NativeLibrary, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype | None, widen: bool) -> torch.Tensor:
    """:func:`linear` on the AVX2 library's GEMMs (``kernels/cpu/avx2/gemm_avx2.c``)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    n = weight.shape[0]
    bias_ptr = None if bias is None else bias.data_ptr()
    if x.dtype == torch.float32:
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        lib.lib.xllm_gemm_f32(x2.data_ptr(), x2.shape[0], k, weight.data_ptr(), n, bias_ptr, y.data_ptr())
        return _cast(y.reshape(*lead, n), out_dtype, widen)
    mode = 2 if widen else 0 if out_dtype == torch.float32 else 1  # (2: bf16-rounded values written as fp32)
    y = torch.empty(x2.shape[0], n, dtype=torch.bfloat16 if mode == 1 else torch.float32)
    lib.lib.xllm_gemm_bf16(x2.data_ptr(), x2.shape[0], k, weight.data_ptr(), n, bias_ptr, y.data_ptr(), mode)
    return _cast(y.reshape(*lead, n), None if widen else out_dtype, False)  # (already fp32 when widened)


def _cast(y: torch.Tensor, out_dtype: torch.dtype | None, widen: bool) -> torch.Tensor:
    """``y`` as :func:`linear` returns it: in ``out_dtype`` if given, float32 with ``widen``."""
    if widen:
        return y.float()
    return y if out_dtype is None else y.to(out_dtype)
