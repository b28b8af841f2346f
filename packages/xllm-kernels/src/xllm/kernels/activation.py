"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up = cat([gate, up], -1)``.

    Contract: the last dim of ``gate_up`` is even; the result has half of it.
    """
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]) * gate_up[..., d:]
