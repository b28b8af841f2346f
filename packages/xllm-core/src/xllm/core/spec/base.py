"""What a speculative proposer is to the engine (:class:`Proposer`), what it is built from, and what
the model-backed proposers ask of the target model (:class:`SupportsLayerPrefix` for ``self``,
:class:`SupportsMTP` for ``mtp``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from xllm.core.config import EngineConfig
    from xllm.core.model_api import AttentionContext, CausalLM, KVCacheSpec
    from xllm.core.sequence import Sequence


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may need to build itself: the engine's config, the target's context length,
    its device, the draft model (``--draft-model``; None unless the engine was given one) and the
    target model itself (``self`` and ``mtp`` draft from it; None where the caller has none)."""

    config: EngineConfig
    max_model_len: int
    device: object
    draft_model: CausalLM | None = None
    target: CausalLM | None = None


class Proposer(Protocol):
    """Proposes draft tokens for decoding sequences.

    Every proposer is deterministic given the sequence's tokens: its draft distribution ``q`` is a
    point mass, which is what :mod:`xllm.core.spec.verify` relies on to keep sampling exact.
    Called on the engine thread, between scheduling and the forward.
    """

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each ``(seq, k)``: up to ``k`` tokens guessed to follow ``seq``'s known tokens (fewer
        or none when it has no guess). ``seq.output_ids`` holds no placeholder here."""
        ...

    def release(self, seq: Sequence) -> None:
        """``seq`` is finished or aborted: drop whatever the proposer keeps for it."""
        ...

    def close(self) -> None:
        """Release the proposer's resources (engine shutdown)."""
        ...


@runtime_checkable
class SupportsLayerPrefix(Protocol):
    """A target model that can lend a view of its first layers (``--speculative self``)."""

    def layer_prefix(self, num_layers: int) -> CausalLM:
        """A :class:`~xllm.core.model_api.CausalLM` running this model's first ``num_layers`` decoder
        layers, then its final norm and LM head, over this model's own weight tensors (no copy). Its
        ``kv_cache_spec()`` has ``num_layers`` layers; layer ``i`` of the view is layer ``i`` here."""
        ...


class MTPLayer(Protocol):
    """One next-token-prediction module (DeepSeek-V3's MTP; ``num_nextn_predict_layers``).

    Row ``t`` of a forward is the module at position ``positions[t]``: its inputs are the token one
    past that position (``input_ids[t]``) and a hidden state of that position (``previous[t]``: the
    target's final hidden state, or this module's own output when chained); it returns its output
    hidden states ``h'``, whose logits (:meth:`compute_logits`) predict the token two past the
    position. Its one attention layer reads and writes KV layer 0 of ``ctx``.
    """

    max_context_len: int
    vocab_size: int

    def kv_cache_spec(self) -> KVCacheSpec: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class SupportsMTP(Protocol):
    """A target model loaded with its multi-token-prediction layers (``--speculative mtp``)."""

    def mtp_layers(self) -> list[MTPLayer]:
        """The loaded MTP modules, in depth order (empty: the model was loaded without them)."""
        ...
