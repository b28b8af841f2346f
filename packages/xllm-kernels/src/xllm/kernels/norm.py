"""RMSNorm with the exact numerics of the Hugging Face reference."""

from __future__ import annotations

import torch


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
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype), residual
