"""Attention over per-sequence contiguous KV regions.

KV layout contract (shared by every KV backend that offers contiguous views):
one tensor per layer for K and one for V, shaped ``[num_slots, max_len,
num_kv_heads, head_dim]``. A sequence owns slot ``s``; its token at position
``p`` lives at ``[s, p]``. The kernels read only ``[s, :length]``, so memory past
a sequence's length may be unmapped or stale. No block table is involved: a
sequence is addressed by (slot, length), i.e. a base offset and a length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          causal: bool, scale: float) -> torch.Tensor:
    """q ``[B, H, n, D]``, k/v ``[B, KVH, L, D]`` -> ``[B, H, n, Dv]`` with GQA."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads not divisible by {kv_heads} KV heads")
        rep = heads // kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: list[int],
    query_starts: list[int],
    context_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention for a packed batch of prompt chunks (varlen).

    ``q`` is ``[T, H, D]`` with sequence ``i``'s ``n_i`` query rows at
    ``[query_starts[i], query_starts[i] + n_i)`` (``query_starts`` has one more
    entry than sequences: the end offset). The chunk's keys are already written
    to the cache; sequence ``i`` attends to ``[slot_i, :context_lens[i]]``, the
    last ``n_i`` of which are the chunk itself (query row ``j`` sees keys
    ``<= context_len - n_i + j``). Returns ``[T, H, Dv]``.
    """
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    for i, slot in enumerate(slots):
        a, b = query_starts[i], query_starts[i + 1]
        n, ctx = b - a, context_lens[i]
        offset = ctx - n
        qi = q[a:b].transpose(0, 1).unsqueeze(0)
        ki = k_cache[slot, :ctx].transpose(0, 1).unsqueeze(0)
        vi = v_cache[slot, :ctx].transpose(0, 1).unsqueeze(0)
        if offset == 0:
            o = _sdpa(qi, ki, vi, None, n > 1, scale)
        else:
            rows = torch.arange(n).unsqueeze(1) + offset
            mask = torch.arange(ctx).unsqueeze(0) <= rows
            o = _sdpa(qi, ki, vi, mask, False, scale)
        out[a:b] = o[0].transpose(0, 1)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence: ``q`` ``[B, H, D]`` -> ``[B, H, Dv]``.

    Sequence ``b`` attends to ``[slots[b], :context_lens[b]]`` (its new token's
    K/V already written). ``slots`` and ``context_lens`` are int64 ``[B]``.
    """
    max_len = int(context_lens.max())
    valid = torch.arange(max_len, device=context_lens.device).unsqueeze(0) < context_lens.unsqueeze(1)  # [B, L]
    # The gather copies [slot, :max_len] for every row, which for shorter rows includes
    # memory past their length (stale, possibly NaN/Inf bit patterns). Zero it: a masked
    # NaN still poisons softmax(QK^T)V (0 * NaN = NaN).
    invalid = ~valid[:, :, None, None]
    k = k_cache[slots, :max_len].masked_fill_(invalid, 0).transpose(1, 2)  # [B, KVH, L, D]
    v = v_cache[slots, :max_len].masked_fill_(invalid, 0).transpose(1, 2)
    o = _sdpa(q.unsqueeze(2), k, v, valid[:, None, None, :], False, scale)
    return o.squeeze(2)
