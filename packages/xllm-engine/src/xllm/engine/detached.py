"""Requests that outlive their ``Generate`` call: the engine side of streams that survive their gateway.

A request's ``Generate`` call can break in two ways: its caller asked for it to end (``Abort``, which a
living gateway sends when its client goes away; the request is aborted at once), or the call broke
without a word (the gateway's process died, its connection reset). In the second case the request is
*detached* (:meth:`DetachedRequests.detach`): it keeps running for ``grace_s`` seconds, a task takes
over its chunk stream and keeps every chunk (those the broken call streamed too, since its caller may
have lost them), and ``EngineService.Reattach`` (:meth:`DetachedRequests.attach`) lets any caller
continue it from an output token offset, the kept chunks first, exactly as the one call would have
streamed them. A request not reattached within ``grace_s`` is aborted (its KV freed); one that
finished meanwhile is forgotten then. ``grace_s`` 0 turns detaching off (a broken call aborts its request).

Contract of a reattached stream: the chunks whose tokens start at ``from_token`` (a chunk boundary,
counted over ``GenerateResponse.token_ids``), then the later ones as they come, ending after the final
chunk, or with the failure that ended the request (an engine failure's status). A Reattach call that
breaks detaches the request again, with a fresh grace period.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from xllm.engine_api.errors import EngineError
from xllm.engine_api.wire import Status, status_for
from xllm.proto.engine.v1 import engine_pb2

log = logging.getLogger(__name__)

_UNFINISHED = engine_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class Detached:
    """One detached request: its chunks so far, whether it ended, whether a call streams it now."""

    request_id: str
    history: list[engine_pb2.GenerateResponse]
    attached: bool = False
    done: bool = False                  # no chunk will follow (final chunk kept, or failure set)
    failure: Status | None = None       # how the request ended without a final chunk
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    pump: asyncio.Task | None = None
    expiry: asyncio.TimerHandle | None = None


class ReattachRefused(Exception):
    """A ``Reattach`` that cannot be served; ``status`` is the call's answer."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.status = Status(code, details)


def start_index(history: list[engine_pb2.GenerateResponse], from_token: int) -> int | None:
    """The index of the first chunk after output token ``from_token`` (a chunk boundary), else None."""
    if from_token == 0:
        return 0
    n = 0
    for i, chunk in enumerate(history):
        n += len(chunk.token_ids)
        if n == from_token:
            return i + 1
        if n > from_token:
            return None
    return None


class DetachedRequests:
    """The detached requests of one engine server (all on its event loop).

    ``abort``: ends a request in the engine (its stream then yields a final ``FINISH_REASON_ABORT`` chunk)."""

    def __init__(self, grace_s: float, abort: Callable[[str], None]) -> None:
        self.grace_s = grace_s
        self._abort = abort
        self._entries: dict[str, Detached] = {}
        self.expired = 0  # requests aborted because their grace period ended unreattached

    @property
    def enabled(self) -> bool:
        return self.grace_s > 0

    def __contains__(self, request_id: str) -> bool:
        """Whether the request is kept here waiting for a ``Reattach`` (detached, no call attached)."""
        entry = self._entries.get(request_id)
        return entry is not None and not entry.attached

    def __len__(self) -> int:
        return len(self._entries)

    def detach(self, request_id: str, history: list[engine_pb2.GenerateResponse],
               pending: asyncio.Future, chunks: AsyncIterator[engine_pb2.GenerateResponse]) -> bool:
        """Keep a request whose call broke running: ``pending`` is the stream's next chunk (not
        cancelled), ``chunks`` the stream. False (nothing taken over) when detaching is off."""
        if not self.enabled:
            return False
        entry = Detached(request_id, history)
        self._entries[request_id] = entry
        entry.pump = asyncio.get_running_loop().create_task(self._pump(entry, pending, chunks))
        self._arm(entry)
        log.info("request %s detached from its call; kept for %g s", request_id, self.grace_s)
        return True

    async def _pump(self, entry: Detached, pending: asyncio.Future,
                    chunks: AsyncIterator[engine_pb2.GenerateResponse]) -> None:
        try:
            while True:
                try:
                    chunk = await pending
                except StopAsyncIteration:
                    break
                entry.history.append(chunk)
                entry.changed.set()
                if chunk.finish_reason != _UNFINISHED:
                    break
                pending = asyncio.ensure_future(anext(chunks))
        except EngineError as exc:
            entry.failure = status_for(exc)
        finally:
            if not pending.done():
                pending.cancel()  # the server stops: leaving the stream aborts the request
            entry.done = True
            entry.changed.set()

    def _arm(self, entry: Detached) -> None:
        entry.expiry = asyncio.get_running_loop().call_later(self.grace_s, self._expire, entry)

    def _expire(self, entry: Detached) -> None:
        if self._entries.get(entry.request_id) is not entry or entry.attached:
            return
        del self._entries[entry.request_id]
        if not entry.done:
            self.expired += 1
            log.info("request %s: not reattached within %g s; aborted", entry.request_id, self.grace_s)
            self._abort(entry.request_id)

    def forget(self, request_id: str) -> bool:
        """An explicit ``Abort``: forget the request (the caller aborts it in the engine). True if it was here."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        if entry.expiry is not None:
            entry.expiry.cancel()
        return True

    def attach(self, request_id: str, from_token: int) -> tuple[Detached, int]:
        """Attach a call to a detached request: the entry and the index of its first chunk to send
        (raises :class:`ReattachRefused`)."""
        entry = self._entries.get(request_id)
        if entry is None:
            raise ReattachRefused(grpc.StatusCode.NOT_FOUND, f"no detached request {request_id!r} here")
        if entry.attached:
            raise ReattachRefused(grpc.StatusCode.FAILED_PRECONDITION, f"request {request_id!r} is attached to a call")
        start = start_index(entry.history, from_token)
        if start is None:
            raise ReattachRefused(grpc.StatusCode.OUT_OF_RANGE,
                                  f"request {request_id!r}: token {from_token} is not a chunk boundary of its stream")
        entry.attached = True
        if entry.expiry is not None:
            entry.expiry.cancel()
        return entry, start

    def release(self, entry: Detached, ended: bool) -> None:
        """The call streaming ``entry`` is over: ``ended`` (it sent everything) forgets the request,
        otherwise it is detached again for a fresh grace period."""
        entry.attached = False
        if self._entries.get(entry.request_id) is not entry:
            return  # aborted meanwhile
        if ended:
            del self._entries[entry.request_id]
        else:
            self._arm(entry)

    async def stream(self, entry: Detached, start: int) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """The attached entry's chunks from ``start`` on, as they come; stops after the final one or
        once the request ended without one (then ``entry.failure`` says how)."""
        i = start
        while True:
            entry.changed.clear()
            while i < len(entry.history):
                chunk = entry.history[i]
                i += 1
                yield chunk
                if chunk.finish_reason != _UNFINISHED:
                    return
            if entry.done:
                return
            await entry.changed.wait()

    async def stop(self, timeout: float = 5.0) -> None:
        """Detach nothing from now on (a broken call aborts its request: the server stops), abort every
        detached request and wait up to ``timeout`` s for their streams to end."""
        self.grace_s = 0.0
        entries = list(self._entries.values())
        for entry in entries:
            self.forget(entry.request_id)
            if not entry.done:
                self._abort(entry.request_id)
        pumps = [e.pump for e in entries if e.pump is not None and not e.pump.done()]
        if pumps:
            await asyncio.wait(pumps, timeout=timeout)
