"""The contract between the engine and a model implementation.

A model (``xllm.models``) is an ``nn.Module`` that satisfies :class:`CausalLM`.
The engine hands it a packed batch of tokens plus an :class:`AttentionContext`
that owns the KV memory; the model never sees how KV is laid out or allocated.

A model may also offer a whole pure-decode step as one native call
(:class:`SupportsFusedDecode`); the engine uses it where the KV backend has
per-slot views and the batch is small enough.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token's KV costs, per layer.

    Standard attention stores K (``num_kv_heads x head_dim``) and V
    (``num_kv_heads x v_head_dim``). A latent-cache model (MLA) stores one
    vector per token: ``num_kv_heads = 1``, ``head_dim = latent + rope dims``
    and ``v_head_dim = 0`` (no separate V).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim) * elem


class AttentionContext(Protocol):
    """Per-forward attention service given to the model by the engine."""

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                  scale: float, v_dim: int | None = None) -> torch.Tensor:
        """Store this step's ``k``/``v`` (``[T, KVH, D]``) for ``layer`` and attend.

        ``q`` is ``[T, H, D]`` in the packed token order of the batch; returns
        ``[T, H, Dv]``. Each token attends causally to its own sequence's cached
        tokens plus the chunk's earlier tokens. A latent cache (MLA) passes
        ``v=None`` and ``v_dim``: the values are the first ``v_dim`` channels of
        the cached keys (one shared KV head), so only ``k`` is stored.
        """
        ...


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model runnable by the engine.

    ``max_context_len`` is the longest sequence the model supports and
    ``vocab_size`` the number of logits it produces.
    """

    max_context_len: int
    vocab_size: int

    def kv_cache_spec(self) -> KVCacheSpec: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """``input_ids``/``positions`` are int64 ``[T]``; returns hidden ``[T, hidden]``."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden rows ``[N, hidden]`` -> float32 logits ``[N, vocab]``."""
        ...


class SlotKV(Protocol):
    """KV memory with per-slot contiguous views: ``layer_kv(layer)`` gives ``[slots, max_len,
    kv_heads, dim]`` K and V tensors that never move while the backend lives."""

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class FusedDecoder(Protocol):
    """A model's whole decode step (every layer) for up to ``max_batch`` sequences in one call."""

    max_batch: int

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 kv: SlotKV) -> torch.Tensor:
        """Final hidden states ``[B, hidden]`` for one new token per sequence: ``input_ids[b]`` at
        ``positions[b]`` of the sequence in slot ``slots[b]`` (its K/V row is written there)."""
        ...


@runtime_checkable
class SupportsFusedDecode(Protocol):
    """Optional part of the model contract: a fused native decode step."""

    def fused_decoder(self) -> FusedDecoder | None:
        """The model's fused decoder, or None where it does not apply (no native kernels, a layout
        the kernel does not implement). Asked once, after the weights are loaded."""
        ...
