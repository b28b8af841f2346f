"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xllm.kernels import native


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up = cat([gate, up], -1)``.

    Contract: the last dim of ``gate_up`` is even; the result has half of it.
    """
    d = gate_up.shape[-1] // 2
    if gate_up.dim() == 2:
        lib = native.for_tensors(gate_up)
        if lib is not None:
            out = gate_up.new_empty(gate_up.shape[0], d)
            getattr(lib.lib, f"xllm_silu_mul_{native.suffix(gate_up.dtype)}")(
                gate_up.data_ptr(), gate_up.shape[0], d, out.data_ptr())
            return out
    return F.silu(gate_up[..., :d]) * gate_up[..., d:]
