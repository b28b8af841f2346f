"""Ops of multi-head latent attention (DeepSeek-V2/V3): interleaved RoPE and the
weight-absorbed projections between per-head spaces and the shared KV latent."""

from __future__ import annotations

import torch


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved channel pairs ``(x0, x1), (x2, x3), ...`` of ``x`` ``[T, heads, d]``.

    ``cos``/``sin`` are ``[T, d]`` in the ``cat([f, f])`` layout of
    :class:`~xllm.kernels.rotary.RotaryTable` (only the first half is read).
    Pair ``i`` rotates by frequency ``i``; the result is returned *de-interleaved*
    (all rotated first members, then all second members), which is the layout
    HF DeepSeek-V3 produces. Applied to both queries and keys, the layout does
    not change any dot product, so it equals DeepSeek-V2's complex-number form.
    """
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """Project per-head no-RoPE queries into the latent space.

    ``q_nope`` ``[T, H, d_nope]``, ``w_uk`` ``[H, d_nope, r]`` (the key half of
    ``kv_b_proj`` per head) -> ``[T, H, r]`` with
    ``out[t, h] = q_nope[t, h] @ w_uk[h]``, so that ``out[t, h] . latent`` equals
    ``q_nope[t, h] . (W_UK[h] latent)``: the expanded key is never formed.
    """
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def expand_values(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Per-head attention outputs in latent space ``[T, H, r]`` -> value space
    ``[T, H, d_v]`` through ``w_uv`` ``[H, d_v, r]`` (the value half of ``kv_b_proj``)."""
    return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
