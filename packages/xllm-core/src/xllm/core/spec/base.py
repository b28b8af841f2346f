"""What a speculative proposer is to the engine (:class:`Proposer`) and what it is built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from xllm.core.config import EngineConfig
    from xllm.core.model_api import CausalLM
    from xllm.core.sequence import Sequence


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may need to build itself: the engine's config, the target's context length,
    its device and the draft model (``--draft-model``; None unless the engine was given one)."""

    config: EngineConfig
    max_model_len: int
    device: object
    draft_model: CausalLM | None = None


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
