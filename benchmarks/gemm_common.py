"""What the GEMM scenarios share (``gemm``, ``gemm_quant``, ``gemm_int8``): the ``--shapes`` flag type and
the "w8a8" format's int8 GEMM (``kernels/cpu/gemm_w8a8.h``, ``--quantization w8a8``) as a candidate."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def weight_shapes(text: str) -> dict[str, tuple[int, int]]:
    """Comma-separated ``NxK`` or ``name=NxK`` weight shapes -> {name: (N, K)}."""
    out = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, dims = part.rpartition("=")
        try:
            n, k = (int(v) for v in dims.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected NxK or name=NxK, got {part!r}") from None
        out[name or f"{n}x{k}"] = (n, k)
    if not out:
        raise argparse.ArgumentTypeError("no shapes given")
    return out


def w8a8_linear(w, path: str = "w8a8") -> Callable | None:
    """``x -> x . W^T`` through the "w8a8" format's int8 GEMM (activation quantization included) for a
    bf16 weight, or None without the native kernels; ``path="w8a8_vnni"`` keeps its tiles on VNNI where
    the CPU has AMX-INT8."""
    import torch

    from xllm.kernels import quant, quant_native

    if quant_native.library() is None or w.dtype != torch.bfloat16 or not quant.supports("w8a8", w.shape[1]):
        return None
    qw = quant_native.kernel_ready(quant.quantize(w, "w8a8"))
    return lambda x: quant_native.linear(x, qw, None, None, path=path)
