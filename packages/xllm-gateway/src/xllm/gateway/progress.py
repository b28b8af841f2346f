"""One request's progress as its client has it, across the instances it ran on.

:class:`~xllm.gateway.dispatch.RoutedStream` keeps one :class:`RequestProgress` per request: what
the client was sent (tokens, characters of text: what a :func:`continuation` starts from), the id
it runs under on its current instance, the instances that failed it, its resumes, moves and crash
strikes, and when its last chunk went out (TPOT samples, the pause a move or resume makes). The
parts that decide what becomes of the request (:class:`~xllm.gateway.failover.Failover`,
:class:`~xllm.gateway.moves.Mover`) are handed it; none of them keeps it.

It also checks that the request progresses on its instance (:func:`watched`, :class:`StallLimits`):
an instance that stopped stepping without breaking its streams off (a stopped process: SIGSTOP, a
frozen VM; a partition) breaks them off itself, as ``InstanceUnavailableError(crashed, suspect)``, which
the failover resumes elsewhere like a crash's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from xllm.engine_api.wire import InstanceUnavailableError
from xllm.proto.engine.v1 import engine_pb2

if TYPE_CHECKING:
    from xllm.gateway.registry import InstanceState

T = TypeVar("T")


@dataclass(frozen=True)
class StallLimits:
    """When a request's stream is taken for stalled on its instance (:func:`watched`):

    - its instance left the registry (its lease expired: no heartbeat for the lease's time) and the
      stream sent nothing for ``gone_silent_s`` (a removed instance that still streams, say after an
      etcd restart lost its record, keeps its requests);
    - once the stream has sent its first chunk, nothing for the larger of ``no_chunk_s`` and
      ``gap_factor`` times its longest gap between chunks so far (0: never; before the first chunk the
      request may wait in the instance's queue, bounded by the client's idle timeout alone).

    ``poll_s``: how often a stream waiting for a chunk looks."""

    no_chunk_s: float = 60.0
    gap_factor: float = 10.0
    gone_silent_s: float = 1.0
    poll_s: float = 0.25

    def stalled(self, state: InstanceState, silent: float, longest_gap: float, streaming: bool) -> str:
        """Why a stream ``silent`` s without a chunk on ``state`` counts as stalled ("" if it does not)."""
        if state.removed and silent > self.gone_silent_s:
            return f"instance {state.instance_id} left the registry and sent nothing for {silent:.1f} s"
        bound = max(self.no_chunk_s, self.gap_factor * longest_gap)
        if streaming and self.no_chunk_s > 0 and silent > bound:
            return f"instance {state.instance_id} sent nothing for {silent:.1f} s mid-stream (bound {bound:.1f} s)"
        return ""


async def watched(chunks: AsyncIterator[T], state: InstanceState, limits: StallLimits) -> AsyncIterator[T]:
    """``chunks`` (a stream from instance ``state``) as they come, broken off with
    ``InstanceUnavailableError(crashed, suspect)`` once :meth:`StallLimits.stalled` says so (nobody can tell
    whether the request is what stopped the instance). Closing it closes ``chunks``.

    Nothing per chunk but two clock reads: a timer looks every ``poll_s`` while the iterating task waits
    for a chunk and, on a stall, cancels that wait as :func:`asyncio.timeout` does (the cancelled read
    cancels the call), which this turns into the error."""
    watch = _Watch(state, limits)
    try:
        while True:
            task = watch.task = asyncio.current_task()  # (the task that waits now: the one a stall cancels)
            watch.waiting_since = time.monotonic()
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if watch.problem and task is not None and task.uncancel() == 0:  # (only the watch's cancel)
                    raise InstanceUnavailableError(watch.problem, state.instance_id, crashed=True,
                                                   suspect=True) from None
                raise
            finally:
                watch.waiting_since = None
            watch.chunk(time.monotonic())
            yield chunk
    finally:
        watch.stop()
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


class _Watch:
    """The timer of :func:`watched`: one stream's chunk times, looked at every ``poll_s``."""

    def __init__(self, state: InstanceState, limits: StallLimits) -> None:
        self.state, self.limits = state, limits
        self.task: asyncio.Task | None = None  # the task waiting for a chunk
        self.last = time.monotonic()  # the last chunk's time (or the start)
        self.longest = 0.0  # the longest gap between chunks so far
        self.streaming = False  # a chunk came
        self.waiting_since: float | None = None  # the iterating task waits for a chunk since then
        self.problem = ""
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(limits.poll_s, self._look)

    def chunk(self, now: float) -> None:
        if self.streaming:
            self.longest = max(self.longest, now - self.last)
        self.last, self.streaming = now, True

    def _look(self) -> None:
        waiting_since = self.waiting_since
        if waiting_since is not None and self.task is not None and not self.problem:
            silent = time.monotonic() - max(self.last, waiting_since)  # (not while its client read slowly)
            self.problem = self.limits.stalled(self.state, silent, self.longest, self.streaming)
            if self.problem:
                self._timer = None
                self.task.cancel()
                return
        self._timer = asyncio.get_running_loop().call_later(self.limits.poll_s, self._look)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


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
