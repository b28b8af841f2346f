"""The contract between the engine and a model implementation.

A model (``xllm.models``) is an ``nn.Module`` that satisfies :class:`CausalLM`.
The engine hands it a packed batch of tokens plus an :class:`AttentionContext`
that owns the KV memory; the model never sees how KV is laid out or allocated.

A model may also offer whole steps as one native call (:class:`SupportsFusedForward`):
small pure-decode steps and general steps mixing decode rows with prefill chunks; the
engine uses it where the KV backend has per-slot views.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
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


@runtime_checkable
class SupportsGreedyHead(Protocol):
    """A :class:`CausalLM` whose head also gives the greedy tokens of hidden rows directly: the engine
    uses it for steps whose every sampled row is a plain greedy pick
    (:meth:`xllm.core.sampler.Sampler.plain_greedy`)."""

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden rows ``[N, hidden]`` -> int64 ``[N]``: ``compute_logits(hidden).argmax(-1)`` exactly (first
        index on ties), without the logits where the model's kernels allow."""
        ...


class SlotKV(Protocol):
    """KV memory with per-slot contiguous rows that never move while the backend lives:
    ``layer_kv(layer)`` gives ``[slots, max_len, kv_heads, dim]`` K and V tensors in the model dtype, or,
    when ``kv_quant_kind`` names a quantized kind (``int8``, ``fp8_e4m3``), ``uint8 [slots, max_len,
    row_bytes]`` rows of :mod:`xllm.kernels.kv_quant`'s layout (per head ``dim`` codes + an fp32 scale)."""

    @property
    def kv_quant_kind(self) -> str | None: ...

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass(frozen=True)
class StepTokens:
    """A packed step as a fused forward reads it under slot addressing (all int64 tensors).

    ``T`` token rows of ``S`` sequences; a decoding sequence is a one-row chunk. Row ``t`` is token
    ``input_ids[t]`` at ``positions[t]`` of the sequence in slot ``token_slots[t]`` (its K/V row is
    written there). Sequence ``s`` owns rows ``[seq_starts[s], seq_starts[s + 1])`` and attends over
    ``[0, context_lens[s])`` of slot ``seq_slots[s]``, whose last rows are its chunk (causal).
    """

    input_ids: torch.Tensor     # [T]
    positions: torch.Tensor     # [T]
    token_slots: torch.Tensor   # [T]
    seq_starts: torch.Tensor    # [S + 1]
    context_lens: torch.Tensor  # [S]
    seq_slots: torch.Tensor     # [S]
    sample_rows: torch.Tensor   # the rows whose final hidden states the caller wants


class FusedForward(Protocol):
    """A model's whole step (every layer) in one native call.

    Pure decode steps of up to ``max_batch`` sequences take :meth:`__call__`; any step of up to
    ``max_step_tokens`` tokens (decode rows and prefill chunks mixed) takes :meth:`step`.
    """

    max_batch: int
    max_step_tokens: int
    #: whether a step whose rows use LoRA adapters may run fused (inside :meth:`LoraSlots.rows`, which tells the
    #: fused forward each row's adapter)
    serves_lora: bool

    def supports(self, kv: SlotKV) -> bool:
        """Whether the fused steps can run over ``kv``'s rows (e.g. its quantized KV format)."""
        ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 kv: SlotKV) -> torch.Tensor:
        """Final hidden states ``[B, hidden]`` for one new token per sequence: ``input_ids[b]`` at
        ``positions[b]`` of the sequence in slot ``slots[b]`` (its K/V row is written there)."""
        ...

    def step(self, tokens: StepTokens, kv: SlotKV) -> torch.Tensor:
        """Final hidden states ``[len(tokens.sample_rows), hidden]`` of a general step."""
        ...


@runtime_checkable
class SupportsFusedForward(Protocol):
    """Optional part of the model contract: fused native steps."""

    def fused_forward(self) -> FusedForward | None:
        """The model's fused forward, or None where it does not apply (no native kernels, a layout
        the kernel does not implement). Asked once, after the weights are loaded."""
        ...


class LoraAdapter(Protocol):
    """An adapter as read (``xllm.models.lora.PeftAdapter``): ``identity`` (64-bit, non-zero) names its files
    (it seeds the chained KV block hashes of its requests); ``rank``."""

    identity: int
    rank: int


class LoraSlots(Protocol):
    """A model's resident LoRA adapters in fixed slots (``xllm.models.lora.LoraStack``)."""

    max_loras: int
    max_rank: int

    def read(self, path: str) -> LoraAdapter:
        """Read and check an adapter directory against the model; ``ValueError`` naming what is wrong."""
        ...

    def install(self, slot: int, adapter: LoraAdapter) -> None: ...

    def clear(self, slot: int) -> None: ...

    def rows(self, slots: torch.Tensor | None) -> AbstractContextManager[None]:
        """Within the block, forwards on this thread give row ``t`` the adapter in slot ``slots[t]`` (-1: none)."""
        ...


@runtime_checkable
class SupportsLora(Protocol):
    """Optional part of the model contract: LoRA adapters served in the same batch as the base model."""

    def lora_stack(self, max_loras: int, max_rank: int) -> LoraSlots:
        """The model's adapter slots (built on the first call); ``ValueError`` where the model cannot serve them."""
        ...
