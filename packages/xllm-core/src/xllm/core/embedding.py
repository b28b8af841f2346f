"""Embeddings: the served model's pooled final hidden state of a prompt (``/v1/embeddings``).

A prompt runs through the model's eager forward once, outside the KV cache: :class:`DenseCausalAttention`
attends each token causally to its own prompt's earlier tokens and stores nothing, so an embedding takes no
KV pages and never touches the prefix cache. The engine runs it on its thread between steps (a command of
:class:`~xllm.core.AsyncEngine`): a long prompt holds the running requests' next step for its forward
(tens of milliseconds for SmolLM2 at a few hundred tokens). Pooling: ``last`` (the last token's state: how
decoder-only embedding models such as Qwen3-Embedding pool, and vLLM's default for them) or ``mean``;
``normalize`` scales to unit L2 norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xllm.core.model_api import CausalLM
from xllm.engine_api.errors import InvalidRequestError

POOLINGS = ("last", "mean")


class DenseCausalAttention:
    """An ``AttentionContext`` over one prompt with no KV cache: causal attention within the prompt."""

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                  scale: float, v_dim: int | None = None) -> torch.Tensor:
        if v is None:  # a latent cache (MLA): the values are the first v_dim channels of the keys
            v = k[..., :v_dim]
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, scale=scale)
        return out.transpose(0, 1)


@torch.inference_mode()
def embed(model: CausalLM, prompt: list[int], pooling: str, normalize: bool, device: torch.device,
          max_len: int) -> tuple[float, ...]:
    """The pooled final hidden state of ``prompt`` (see the module docstring); ``InvalidRequestError`` naming
    ``input`` for an empty or too long prompt, ``pooling`` for an unknown pooling."""
    if pooling not in POOLINGS:
        raise InvalidRequestError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}", "pooling")
    if not prompt or len(prompt) > max_len:
        raise InvalidRequestError(f"an input has {len(prompt)} tokens; between 1 and {max_len} are served", "input")
    ids = torch.tensor(prompt, dtype=torch.long, device=device)
    hidden = model.forward(ids, torch.arange(len(prompt), device=device), DenseCausalAttention()).float()
    pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
    if normalize:
        pooled = F.normalize(pooled, dim=0)
    return tuple(pooled.tolist())  # (a tuple: an engine command's list result reads as chunks to deliver)
