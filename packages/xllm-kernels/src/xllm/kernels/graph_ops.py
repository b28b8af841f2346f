"""Custom torch ops that let ``torch.compile`` capture a decode step as one graph.

The attention op writes the step's K/V into the cache tensors (graph inputs it
mutates) and attends over (slot, length) contiguous KV; Inductor treats it as
an opaque call and compiles everything around it.
"""

from __future__ import annotations

import torch

from xllm.kernels.attention import decode_attention


@torch.library.custom_op("xllm::decode_attention_write", mutates_args=("k_cache", "v_cache"))
def decode_attention_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Store ``k``/``v`` ``[B, KVH, D]`` at ``(slots, positions)`` and attend over
    ``[slot, :position + 1]``: ``q`` ``[B, H, D]`` -> ``[B, H, Dv]``."""
    k_cache[slots, positions] = k
    v_cache[slots, positions] = v
    return decode_attention(q, k_cache, v_cache, slots, positions + 1, scale)


@decode_attention_write.register_fake
def _(q, k, v, k_cache, v_cache, slots, positions, scale):
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
