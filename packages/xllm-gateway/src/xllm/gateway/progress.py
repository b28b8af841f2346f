"""One request's progress as its client has it, across the instances it ran on.

:class:`~xllm.gateway.dispatch.RoutedStream` keeps one :class:`RequestProgress` per request: what
the client was sent (tokens, characters of text: what a :func:`continuation` starts from), the id
it runs under on its current instance, the instances that failed it, its resumes, moves and crash
strikes, and when its last chunk went out (TPOT samples, the pause a move or resume makes). The
parts that decide what becomes of the request (:class:`~xllm.gateway.failover.Failover`,
:class:`~xllm.gateway.moves.Mover`) are handed it; none of them keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xllm.proto.engine.v1 import engine_pb2


def continuation(req: engine_pb2.GenerateRequest, generated: list[int], sent_chars: int,
                 attempt: int) -> engine_pb2.GenerateRequest:
    """``req`` continued elsewhere after the client received ``generated`` tokens and the first
    ``sent_chars`` characters of their text: its prompt plus those tokens, marked as earlier output
    (``resumed_output_tokens``, ``resumed_sent_chars``: the instance replays them, so max_tokens,
    penalties, stop strings and held-back text continue exactly).

    The continuation runs under its own id, ``<id>#<attempt>``: an instance may still hold what is
    left of the earlier attempt (a decode instance whose prefill partner died keeps the abandoned
    reservation until the hand-off ends, and the abort of the broken call can arrive late), and the
    two must never be taken for one another."""
    cont = engine_pb2.GenerateRequest()
    cont.CopyFrom(req)
    cont.request_id = f"{req.request_id}#{attempt}"
    cont.prompt_token_ids.extend(generated)
    cont.resumed_output_tokens = len(generated)
    cont.resumed_sent_chars = sent_chars
    return cont


@dataclass
class RequestProgress:
    """One request across its instances (see the module docstring)."""

    request: engine_pb2.GenerateRequest
    instance_request_id: str = ""  # the id it runs under on its instance ("": the request's own)
    generated: list[int] = field(default_factory=list)  # every token streamed so far, across instances
    sent_chars: int = 0  # characters of text streamed so far
    failed: set[str] = field(default_factory=set)  # instances that broke it off (not placed there again)
    resumes: int = 0
    moves: int = 0
    crash_strikes: int = 0
    attempts: int = 0  # continuations named so far (<id>#<n>: each n once, moves that never happened too)
    last_chunk: float = 0.0  # when the last chunk went out (time.monotonic)
    pause: tuple[str, float] | None = None  # how it last left an instance, and its last chunk's time before

    def __post_init__(self) -> None:
        self.instance_request_id = self.instance_request_id or self.request.request_id

    @property
    def num_tokens(self) -> int:
        """Its prompt and the tokens streamed so far."""
        return len(self.request.prompt_token_ids) + len(self.generated)

    def next_continuation(self) -> engine_pb2.GenerateRequest:
        """The request continued from what the client has, under the next unused ``<id>#<n>``."""
        self.attempts += 1
        return continuation(self.request, self.generated, self.sent_chars, self.attempts)

    def sent(self, chunk: engine_pb2.GenerateResponse, now: float) -> tuple[str, float] | None:
        """``chunk`` goes to the client at ``now`` (under the request's id, also from a continuation
        running as ``<id>#<n>``); returns the pause it ends, (how the request left its last instance,
        seconds since its last chunk there), or None."""
        self.last_chunk = now
        pause, self.pause = self.pause, None
        chunk.request_id = self.request.request_id
        self.generated.extend(chunk.token_ids)
        self.sent_chars += len(chunk.text)
        return None if pause is None else (pause[0], now - pause[1])

    def left(self, how: str) -> None:
        """The request left its instance (``resumed``, ``migrated``, ``recomputed``): the pause runs
        from its last chunk there to its next."""
        self.pause = (how, self.last_chunk)
