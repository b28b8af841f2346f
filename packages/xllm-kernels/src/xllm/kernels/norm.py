"""RMSNorm with the exact numerics of the Hugging Face reference."""

from __future__ import annotations

import torch

from xllm.kernels import native


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normalize ``x`` (optionally after adding ``residual``) over the last dim.

    Contract: statistics are computed in float32 and the normalized value is cast
    back to ``x.dtype`` before the weight multiply (as HF Llama does). When
    ``residual`` is given, returns ``(norm(x + residual), x + residual)`` so the
    caller can carry the new residual; otherwise ``(norm(x), None)``.
    """
    if x.dim() == 2 and (residual is None or residual.shape == x.shape):
        lib = native.for_tensors(x, weight, *(() if residual is None else (residual,)))
        if lib is not None:
            return _native_rms_norm(lib, x, weight, eps, residual)
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype), residual


def _native_rms_norm(lib, x, weight, eps, residual):
    out = torch.empty_like(x)
    new_residual = None if residual is None else torch.empty_like(x)  # x + residual, rounded like the eager add
    fn = getattr(lib.lib, f"xllm_add_rmsnorm_{native.suffix(x.dtype)}")
    fn(x.data_ptr(), None if residual is None else residual.data_ptr(),
       None if new_residual is None else new_residual.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1],
       float(eps), out.data_ptr())
    return out, new_residual
