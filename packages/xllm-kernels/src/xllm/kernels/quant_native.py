"""Native quantized products (``kernels/cpu/gemm_quant.{h,c}``) behind :func:`xllm.kernels.quant.quant_linear`.

bf16 activations over 2+ rows run on AMX where the CPU has it (:func:`amx_ready`: weights dequantized
to bf16 in groups of 16 rows, tile products). Otherwise up to 8 rows run the skinny GEMV (activations
rounded to 16 bits per 32-block, AVX512-VNNI dot products, one pass over the packed weight), 9 to 16 rows
the GEMV over chunks of 8 rows; more rows dequantize 48-row panels into the blocked bf16/fp32 GEMM's
layout and run its micro-kernel, or for ``"w8a8"`` weights round the activations to int8 and run the
VNNI int8 GEMM (``kernels/cpu/gemm_w8a8.h``) (``kernels/cpu/gemm_quant.h`` has
the algorithms and the measurements behind the thresholds). On CPUs without AVX512-VNNI the AVX2
library runs instead (``kernels/cpu/avx2/quant_avx2.c``: the same 16-bit activations, VPMADDWD dot
products, one algorithm for every M; ``path`` is ignored there and ``"w8a8"`` weights take the torch
reference). :func:`linear` returns None whenever no native library can run the product (no library,
``XLLM_NATIVE=0``, no AVX2, under ``torch.compile``, an unsupported dtype or device); the caller then
takes the torch path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from xllm.kernels import gemm, native

if TYPE_CHECKING:
    from xllm.kernels.quant import QuantizedWeight

#: format name -> the kernels' XQ_* tag (gemm_quant.h)
QUANT_TAGS: dict[str, int] = {"q8_0": 1, "q4_0": 2, "q4_1": 3, "int8": 4, "int4_g32": 5, "int4_g128": 6, "w8a8": 7}
#: paths of xllm_quant_linear: automatic, skinny GEMV (<= 8 rows), panel GEMM, GEMV over chunks of 8 rows (any M),
#: AMX (bf16 x where :func:`amx_ready`, else automatic), the W8A8 GEMM (int8-layout weights, any M; its tiles on
#: AMX-INT8 where :func:`amx_int8_ready` and the weight has its panels with K % 64 == 0), the W8A8 GEMM on VNNI only
PATHS: dict[str, int] = {"auto": 0, "gemv": 1, "panels": 2, "gemv_chunks": 3, "amx": 4, "w8a8": 5, "w8a8_vnni": 6}
MAX_GEMV_ROWS = 8
_VP, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


QWeight = native.QWeight  # the C struct XllmQWeight


def kernel_ready(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw`` with the dtypes the kernels read (contiguous; int8 scales fp32, int4 scales fp16)."""
    from xllm.kernels.quant import PER_CHANNEL_FORMATS  # (quant imports this module)

    qw = qw.contiguous()
    want = torch.float32 if qw.fmt in PER_CHANNEL_FORMATS else torch.float16
    if qw.scales is not None and qw.scales.dtype != want:
        qw = type(qw)(qw.fmt, qw.n, qw.k, qw.data, qw.scales.to(want).contiguous(), qw.zeros, qw.packed)
    return qw


def struct(qw: QuantizedWeight) -> QWeight:
    """The C view of ``qw`` (which must be :func:`kernel_ready` and outlive the struct)."""
    return QWeight(QUANT_TAGS[qw.fmt], qw.data.data_ptr(),
                   None if qw.scales is None else qw.scales.data_ptr(),
                   None if qw.zeros is None else qw.zeros.data_ptr(),
                   None if qw.packed is None else qw.packed.data_ptr())


def library() -> native.NativeLibrary | None:
    """The library that runs the quantized kernels here: the AVX-512 one where the CPU has AVX512-VNNI, else
    the AVX2 one (:func:`xllm.kernels.native.avx2_library`: the same entry points, one GEMV algorithm for
    every M, no W8A8 GEMM), else None."""
    lib = native.library()
    if lib is not None and "avx512_vnni" in native.cpu_flags():
        return lib
    return native.avx2_library()


def w8a8_ready() -> bool:
    """Whether ``"w8a8"`` weights run natively here (the W8A8 GEMM of the AVX-512 library; elsewhere
    :func:`xllm.kernels.quant.w8a8_reference` computes them)."""
    lib = library()
    return lib is not None and lib.isa == "avx512"


def amx_ready() -> bool:
    """Whether the AMX path (bf16 activations, 2+ rows; ``kernels/cpu/gemm_quant_amx.h``) runs here: the
    quantized kernels run and :func:`xllm.kernels.gemm.amx_ready`."""
    return library() is not None and gemm.amx_ready()


def amx_int8_ready() -> bool:
    """Whether the W8A8 GEMM runs its tiles on AMX-INT8 here (``kernels/cpu/gemm_w8a8_amx.h``: the quantized
    kernels run and CPUID has AMX-INT8 besides :func:`amx_ready`'s AMX-TILE/AMX-BF16)."""
    lib = library()
    return lib is not None and bool(lib.fn("xllm_amx_int8_ready", [], _I32)())


@dataclass(frozen=True)
class _Operands:
    """A product's operands as the kernels take them: the library, contiguous ``x``, the kernel-ready
    weight and its C view, the bias in ``x``'s dtype (or None)."""

    lib: native.NativeLibrary
    x: torch.Tensor
    qw: QuantizedWeight
    w: QWeight
    bias: torch.Tensor | None

    @property
    def bias_ptr(self) -> int | None:
        return None if self.bias is None else self.bias.data_ptr()


def _operands(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
              weight_only: bool = False) -> _Operands | None:
    """The operands of a native product, or None where the native path does not apply (no library,
    ``XLLM_NATIVE=0``, neither AVX512-VNNI nor AVX2, under ``torch.compile``, another dtype or device; a
    ``"w8a8"`` weight's W8A8 product on the AVX2 library; ``weight_only``: the caller runs it as int8 instead)."""
    if torch.compiler.is_compiling() or x.dim() != 2 or x.device.type != "cpu":
        return None
    if x.dtype not in (torch.bfloat16, torch.float32) or qw.data.device.type != "cpu":
        return None
    lib = library()
    if lib is None or (qw.fmt == "w8a8" and not weight_only and not w8a8_ready()):  # (AVX2: no W8A8 GEMM)
        return None
    qw = kernel_ready(qw)
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    return _Operands(lib, x.contiguous(), qw, struct(qw), bias)


def linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
           path: str = "auto") -> torch.Tensor | None:
    """``x [m, k] @ dequantize(qw).T + bias`` natively, or None when the native path does not apply.
    bf16 ``x`` gives bf16 (or fp32 with ``out_dtype=torch.float32``); fp32 ``x`` gives fp32 (cast to
    ``out_dtype`` if given)."""
    op = _operands(x, qw, bias, weight_only=path in ("gemv", "panels", "gemv_chunks"))
    if op is None:
        return None
    (m, k), n = op.x.shape, op.qw.n
    bf16 = op.x.dtype == torch.bfloat16
    out_bf16 = bf16 and out_dtype != torch.float32
    y = torch.empty(m, n, dtype=torch.bfloat16 if out_bf16 else torch.float32)
    fn = op.lib.fn("xllm_quant_linear", [ctypes.POINTER(QWeight), _VP, _I32, _I64, _I64, _I64, _VP, _VP, _I32, _I32])
    fn(ctypes.byref(op.w), op.x.data_ptr(), int(bf16), m, k, n, op.bias_ptr, y.data_ptr(), int(out_bf16), PATHS[path])
    if out_dtype is not None and y.dtype != out_dtype:
        y = y.to(out_dtype)
    return y


def argmax(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The row argmax (int64 ``[m]``, first index on ties) of ``linear(x, qw, bias, None)`` (as float32),
    bit for bit, without writing the product (``kernels/cpu/lm_head.c``: a greedy LM head), or None
    where :func:`linear` would return None."""
    op = _operands(x, qw, bias)
    if op is None:
        return None
    m, k = op.x.shape
    out = torch.empty(m, dtype=torch.int64)
    op.lib.fn("xllm_head_argmax_quant", [ctypes.POINTER(QWeight), _VP, _I32, _I64, _I64, _I64, _VP, _VP])(
        ctypes.byref(op.w), op.x.data_ptr(), int(op.x.dtype == torch.bfloat16), m, k, op.qw.n, op.bias_ptr,
        out.data_ptr())
    return out


def gather_rows(qw: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``dequantize(qw.rows(ids), dtype)`` bit for bit (a quantized embedding's lookup: ``[len(ids), k]``),
    without the intermediate weight, or None where the native path does not apply (no library, another
    dtype than bf16/fp32, under ``torch.compile``). ``ids``: 1-D int64, every id in ``[0, qw.n)``."""
    if torch.compiler.is_compiling() or dtype not in (torch.bfloat16, torch.float32):
        return None
    lib = library()
    if lib is None:
        return None
    qw = kernel_ready(qw)
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), qw.k, dtype=dtype)
    w = struct(qw)
    lib.fn("xllm_quant_gather_rows", [ctypes.POINTER(QWeight), _I64, _VP, _I64, _VP, _I32])(
        ctypes.byref(w), qw.k, ids.data_ptr(), ids.numel(), out.data_ptr(), int(dtype == torch.bfloat16))
    return out


def dequantize_f32(qw: QuantizedWeight) -> torch.Tensor | None:
    """The native dequantization to fp32 ``[n, k]`` (bit-equal to :func:`xllm.kernels.quant.dequantize`),
    or None without the library."""
    lib = library()
    if lib is None:
        return None
    qw = kernel_ready(qw)
    out = torch.empty(qw.n, qw.k, dtype=torch.float32)
    w = struct(qw)
    lib.fn("xllm_quant_dequantize_f32", [ctypes.POINTER(QWeight), _I64, _I64, _VP])(
        ctypes.byref(w), qw.k, qw.n, out.data_ptr())
    return out
