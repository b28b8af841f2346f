"""What the engine tells the outside about a request's prefill/decode hand-off, and the contract
of whoever moves the KV (the engine service, :mod:`xllm.engine.handoff`), attached with
``LLMEngine.attach_disagg``. The engine service calls the engine's side (``install_kv``,
``release_kv``, ``move_snapshot``, ``pause_for_move``) through its handle,
:class:`~xllm.core.async_engine.AsyncEngine`, whose typed commands run them on the engine thread.

Prefill side: a request in :attr:`Phase.PREFILL <xllm.core.sequence.Phase>` runs as usual until it
samples its first token. When a step is about to compute the last chunk of its prompt the engine
says so (:meth:`DisaggListener.on_prompt_finishing`); a listener that wants to send the KV layer by
layer while that forward runs returns a callback, called with each layer's index once the layer's
KV is stored. The chunk with the first token is streamed, then the engine keeps the sequence's KV
(status ``HANDING_OFF``) and reports a :class:`Handoff`. Whoever sends the KV calls
``LLMEngine.release_kv`` when the decode side has it (or gave up); the request's stream then ends
with ``FINISH_REASON_HANDED_OFF``. A prefill-phase request that ends without a hand-off (its first
token ended it, or it was aborted before) is reported ``on_abandoned``.

Decode side: a request in :attr:`Phase.DECODE` first gets KV memory for its whole prompt (its
locally cached prefix reused); the engine reports a :class:`Reservation` naming the pages to fill.
The KV's receiver calls ``LLMEngine.install_kv`` with the :class:`~xllm.proto.engine.v1.engine_pb2.KVCommit`
(first token, sampler state) once the pages hold the prompt's KV, or with ``received=False`` when
the transfer failed (the engine then computes the missing part itself). Either way the request
continues as if one engine had served it from the start.

Migration (a running request moved off a draining instance, xLLM §3.5) uses the same two sides.
Source: :meth:`LLMEngine.move_snapshot <xllm.core.engine.LLMEngine.move_snapshot>` names the KV a
running request holds now (its full blocks can be copied while it keeps decoding);
``pause_for_move`` stops scheduling it once no step in flight computes it, keeps its KV (status
``HANDING_OFF``) and reports :class:`MoveReady`; ``release_kv`` then ends its stream with
``FINISH_REASON_HANDED_OFF``. Destination: a decode-phase request reserved KV for the request's
tokens so far; ``install_kv`` with a ``MIGRATION_STAGE_FINAL`` commit takes the KV of its first
``num_tokens`` tokens, appends what the source produced after the reservation and continues.

A request aborted while its KV is being handed off keeps its pages (a transfer may be reading or
writing them): the listener hears ``on_abandoned`` and calls ``LLMEngine.release_kv`` once no
transfer touches them; ``release_kv`` also drops a decode reservation that expired.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from xllm.proto.engine.v1 import engine_pb2


@dataclass(frozen=True)
class Reservation:
    """Decode side: KV memory reserved for a request's prompt."""

    request_id: str
    num_tokens: int       # prompt tokens
    matched_tokens: int   # leading tokens found in the local prefix cache (whole blocks): not to be sent
    pages: tuple[int, ...]  # the page of each prompt block; blocks from matched_tokens // block_size get the KV


@dataclass(frozen=True)
class Handoff:
    """Prefill side: a request's prompt is computed and its first token sampled; its KV is held."""

    request_id: str
    target: engine_pb2.KVTarget
    num_tokens: int
    pages: tuple[int, ...]
    first_token: int
    queue_seconds: float
    prefill_seconds: float
    sampled_at: float = field(default=0.0)  # time.time() of the first token
    # the chained hash of every full prompt block (the key of a block in every KV tier: a hand-off through
    # the cluster store publishes the blocks under them)
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class MoveSnapshot:
    """Migration source: the KV a running request holds now. Blocks wholly within
    ``num_computed_tokens`` are final while it runs (a forward in flight is not counted); a change
    of ``num_preemptions`` later means its pages were released meanwhile."""

    request_id: str
    num_computed_tokens: int
    pages: tuple[int, ...]
    num_preemptions: int


@dataclass(frozen=True)
class MoveReady:
    """Migration source: the request stopped here (no step computes it); its KV is held."""

    request_id: str
    num_computed_tokens: int
    pages: tuple[int, ...]
    token_ids: tuple[int, ...]  # prompt (an earlier run's output included) and output, as known here
    sent_chars: int             # characters of output text its stream carried (all runs)
    num_preemptions: int


@dataclass(frozen=True)
class PromptFinishing:
    """Prefill side: the next forward computes the last chunk of this prompt, so every block's KV
    becomes final, layer by layer, while it runs."""

    request_id: str
    target: engine_pb2.KVTarget
    num_tokens: int
    pages: tuple[int, ...]  # the page of every prompt block


LayerObserver = Callable[[int], None]
"""Called with a layer's index once a forward stored that layer's KV (on the forward's thread)."""


class DisaggListener(Protocol):
    """Told about hand-offs, on the engine thread (must be quick: hand the work to another thread)."""

    def on_reserved(self, reservation: Reservation) -> None: ...

    def on_prompt_finishing(self, prompts: list[PromptFinishing]) -> LayerObserver | None:
        """The next forward completes these prompts; return a callback to hear each layer stored
        during it (or ``None``)."""
        ...

    def on_handoff(self, handoff: Handoff) -> None: ...

    def on_move_ready(self, ready: MoveReady) -> None:
        """A request paused for migration (``pause_for_move``) stopped; its KV is held."""
        ...

    def on_abandoned(self, request_id: str) -> None:
        """No hand-off will happen: aborted mid-hand-off (its KV then waits for ``release_kv``), or
        a prefill-phase request that ended before handing off."""
        ...
