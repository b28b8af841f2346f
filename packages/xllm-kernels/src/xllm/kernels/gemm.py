"""The native blocked GEMM over packed weights (``kernels/cpu/gemm_packed.{h,c}``), for any row count.

``y[M, N] = x[M, K] @ W[N, K]^T (+ bias)`` in bf16 (AVX512-BF16 ``vdpbf16ps``, fp32 accumulation,
one rounding to nearest-even of the output) or fp32 (FMA). :func:`pack` makes the packed copy once
(panels of 48 output columns, ``[K/2][48][2]`` bf16 pairs or ``[K][48]`` fp32, zero-padded to a
multiple of 48 columns); :func:`packed_linear` runs the product on torch's OpenMP threads.
Whether it beats oneDNN for a given shape and row count is measured, not assumed: see
:mod:`xllm.kernels.gemm_choice`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from xllm.kernels import native

_VP, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[n, k]`` in the native packed layout (``data`` is 1-D, ``numel(n, k)`` elements)."""

    data: torch.Tensor
    n: int
    k: int
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.data.data_ptr()


def _k_ok(k: int, dtype: torch.dtype) -> bool:
    return k >= 1 and (k % 2 == 0 if dtype == torch.bfloat16 else True)


def numel(n: int, k: int) -> int | None:
    """Elements of the packed copy of an ``[n, k]`` weight, or None without the native library."""
    lib = native.library()
    if lib is None:
        return None
    return int(lib.fn("xllm_gemm_packed_numel", [_I64, _I64], _I64)(n, k))


def pack_supported(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` can pack ``weight``: 2-D bf16/fp32 on the CPU (bf16 with an even K), not
    under ``torch.compile``, with the native library available."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return False
    n, k = weight.shape
    if n < 1 or not _k_ok(k, weight.dtype) or torch.compiler.is_compiling():
        return False
    return native.library() is not None


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """The packed copy of a 2-D bf16/fp32 CPU ``weight [N, K]``, or None where the native library is
    unavailable or the shape is outside the contract (see :func:`pack_supported`)."""
    if not pack_supported(weight):
        return None
    lib = native.library()
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = torch.empty(numel(n, k), dtype=w.dtype)
    name = "xllm_gemm_pack_bf16" if w.dtype == torch.bfloat16 else "xllm_gemm_pack_f32"
    lib.fn(name, [_VP, _I64, _I64, _VP])(w.data_ptr(), n, k, out.data_ptr())
    return PackedWeight(out, n, k, w.dtype)


#: kernel choices of a bf16 product (``kernels/cpu/gemm_packed.c``): automatic (AMX from a few rows where
#: :func:`amx_ready`, else AVX-512), the AVX-512 ``vdpbf16ps`` kernel, the AMX ``tdpbf16ps`` one
BF16_PATHS: dict[str, int] = {"auto": 0, "avx512": 1, "amx": 2}


def amx_ready() -> bool:
    """Whether the AMX kernels run here (``kernels/cpu/amx.h``: CPUID AMX-TILE/AMX-BF16, tile data granted
    to this process, ``XLLM_AMX`` not ``0``)."""
    lib = native.library()
    return lib is not None and bool(lib.fn("xllm_amx_ready", [], _I32)())


#: output modes of the bf16 kernels (``GP_OUT_*`` in ``kernels/cpu/gemm_packed.h``)
_OUT_F32, _OUT_BF16, _OUT_WIDENED = 0, 1, 2


def _checked(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None, caller: str) -> native.NativeLibrary:
    """The native library, once ``x [..., K]`` and ``bias [N]`` match ``pw`` (ValueError otherwise)."""
    if x.dtype != pw.dtype or x.shape[-1] != pw.k:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not match the packed weight [{pw.n}, {pw.k}] {pw.dtype}")
    if bias is not None and (bias.shape != (pw.n,) or bias.dtype != pw.dtype):
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} does not match [{pw.n}] {pw.dtype}")
    lib = native.library()
    if lib is None:
        raise RuntimeError(f"{caller} needs the native library (a PackedWeight exists only where it loaded)")
    return lib


def packed_linear(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, path: str = "auto", widen: bool = False) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` given packed; ``x [..., K]`` in ``pw.dtype`` (2-D inputs may have a
    row stride), ``bias [N]`` in ``pw.dtype``. ``out_dtype=torch.float32`` returns the fp32 sums of a
    bf16 product directly (no bf16 rounding); other ``out_dtype`` values convert the result. ``path``
    (bf16 only) forces a kernel of :data:`BF16_PATHS`; ``"amx"`` raises ValueError where it cannot run
    (no AMX, or K not a multiple of 32). ``widen`` (bf16 only, no ``out_dtype``) returns the bf16 result as
    float32, bit for bit ``packed_linear(x, pw, bias).float()``, written once (an LM head's logits)."""
    if widen and (pw.dtype != torch.bfloat16 or out_dtype is not None):
        raise ValueError("widen applies to a bf16 product without out_dtype")
    lib = _checked(x, pw, bias, "packed_linear")
    lead = x.shape[:-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, pw.k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < pw.k):
        x2 = x2.contiguous()
    m = x2.shape[0]
    bias_ptr = None if bias is None else bias.contiguous().data_ptr()
    if pw.dtype == torch.bfloat16:
        mode = _OUT_WIDENED if widen else _OUT_F32 if out_dtype == torch.float32 else _OUT_BF16
        y = torch.empty(m, pw.n, dtype=torch.bfloat16 if mode == _OUT_BF16 else torch.float32)
        if m:
            rc = lib.fn("xllm_gemm_packed_path_bf16", [_VP, _I64, _I64, _I64, _VP, _I64, _VP, _VP, _I64, _I32, _I32],
                        _I32)(x2.data_ptr(), x2.stride(0), m, pw.k, pw.data_ptr(), pw.n, bias_ptr, y.data_ptr(),
                              pw.n, mode, BF16_PATHS[path])
            if rc != 0:
                raise ValueError(f"the {path} kernel cannot run [{m}, {pw.k}] x [{pw.n}, {pw.k}] here")
    else:
        y = torch.empty(m, pw.n, dtype=torch.float32)
        if m:
            lib.fn("xllm_gemm_packed_strided_f32", [_VP, _I64, _I64, _I64, _VP, _I64, _VP, _VP, _I64])(
                x2.data_ptr(), x2.stride(0), m, pw.k, pw.data_ptr(), pw.n, bias_ptr, y.data_ptr(), pw.n)
    y = y.reshape(*lead, pw.n)
    return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)


def packed_argmax(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The row argmax (int64 ``[M]``, first index on ties) of the logits ``packed_linear(x, pw, bias,
    widen=True)`` writes (``packed_linear(x, pw, bias)`` for fp32), bit for bit, without writing them: a
    greedy LM head (``kernels/cpu/lm_head.c``). ``x [M, K]`` in ``pw.dtype``, NaN-free products."""
    if x.dim() != 2:
        raise ValueError(f"packed_argmax takes x [M, K], got {tuple(x.shape)}")
    lib = _checked(x, pw, bias, "packed_argmax")
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    name = "xllm_head_argmax_packed_bf16" if pw.dtype == torch.bfloat16 else "xllm_head_argmax_packed_f32"
    lib.fn(name, [_VP, _I64, _I64, _VP, _I64, _VP, _VP])(
        x.data_ptr(), x.shape[0], pw.k, pw.data_ptr(), pw.n, None if bias is None else bias.contiguous().data_ptr(),
        out.data_ptr())
    return out
