"""PD mode: one request served by a prefill instance and a decode instance, as one stream.

The flow (docs/architecture.md, "Prefill/decode disaggregation"):

1. the decode instance is asked first (``DISAGG_PHASE_DECODE``): it reserves KV for the prompt,
   reusing its own prefix cache, and answers with the :class:`KVTarget` (transport, endpoint,
   prefix it holds);
2. the prefill instance gets the request with that target (``DISAGG_PHASE_PREFILL``): it computes
   what its own prefix cache lacks, streams the first token (the client sees it at once) and sends
   the KV the decode side lacks; its stream ends with ``FINISH_REASON_HANDED_OFF``;
3. the decode instance continues from the handed-off KV (or recomputes if the transfer failed).

:class:`PDStream` is what the dispatcher's :class:`~xllm.gateway.dispatch.RoutedStream` iterates:
a prefill instance that fails before the first token is replaced by another (the reservation
waits); one that fails after it leaves the decode side a grace period to show it has the KV, else
the request is resumed elsewhere like any broken stream; a decode instance that fails does the same.
Leaving early (the client went away) closes both sides, which frees both reservations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from xllm.engine_api.wire import InstanceUnavailableError
from xllm.gateway.progress import StallLimits, watched
from xllm.gateway.router import Router, Ticket
from xllm.gateway.tracing import NO_SPANS, RequestSpans
from xllm.proto.engine.v1 import engine_pb2

if TYPE_CHECKING:
    from xllm.gateway.metrics import PDMetrics

log = logging.getLogger(__name__)

HANDED_OFF = engine_pb2.FINISH_REASON_HANDED_OFF
MAX_PREFILL_ATTEMPTS = 3


def phase_request(req: engine_pb2.GenerateRequest, phase: int,
                  target: engine_pb2.KVTarget | None = None) -> engine_pb2.GenerateRequest:
    out = engine_pb2.GenerateRequest()
    out.CopyFrom(req)
    out.disagg_phase = phase
    if target is not None:
        out.kv_target.CopyFrom(target)
    return out


def decodes(stream: object) -> bool:
    """Whether a request's stream runs its decode phase where it is placed: a :class:`PDStream`
    once its decode instance streams, any other stream always."""
    return not isinstance(stream, PDStream) or stream.decoding


class PrefillPlacer(Protocol):
    """What a :class:`PDStream` asks of the dispatcher (:class:`~xllm.gateway.dispatch.Dispatcher`)."""

    async def submit_prefill(self, model: str, req: engine_pb2.GenerateRequest, target: engine_pb2.KVTarget,
                             session: str | None, exclude: set[str], ticket: Ticket | None = None,
                             spans: RequestSpans = NO_SPANS) -> tuple[Ticket, object, int]:
        """The prefill phase of ``req`` sent to another prefill instance: its ticket, stream and the
        instances tried."""
        ...

    def background(self, coro) -> asyncio.Future:
        """``coro`` run detached from the request (kept alive until it ends)."""
        ...


@dataclass
class PDTimes:
    """Where one request's time to first token went (seconds)."""

    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    queue: float = 0.0
    prefill: float = 0.0
    transfer: float = 0.0
    first_decode: float | None = None


class PDStream:
    """The chunks of one request across its prefill and decode instances (see the module docstring)."""

    def __init__(self, placer: PrefillPlacer, router: Router, metrics: PDMetrics, model: str,
                 req: engine_pb2.GenerateRequest, prefill: Ticket, prefill_stream, decode: Ticket,
                 decode_iter: AsyncIterator, target: engine_pb2.KVTarget, session: str | None = None,
                 handoff_grace: float = 5.0, prefill_attempts: int = 1, spans: RequestSpans = NO_SPANS,
                 stall: StallLimits | None = None) -> None:
        """``placer``: another prefill instance when one fails before the first token; ``router``: the
        prefill side's accounting and TTFT; ``metrics``: the PD metrics this stream counts (transfers,
        TTFT breakdown, prefill retries, lost hand-offs, cancelled requests); ``prefill_attempts``: the
        prefill instances already tried to send ``prefill_stream`` (:meth:`PrefillPlacer.submit_prefill`'s
        count); ``stall``: when a silent prefill instance is taken for stopped (:func:`watched`: one that left
        the registry breaks its stream off, before the first token as after it), as the decode side's
        stream is by its :class:`~xllm.gateway.dispatch.RoutedStream`."""
        self._placer = placer
        self._router = router
        self._metrics = metrics
        self._model = model
        self._req = req
        self.prefill = prefill
        self._p_stream = prefill_stream
        self.decode = decode
        self._d_iter = decode_iter
        self.target = target
        self._session = session
        self._grace = handoff_grace
        self.times = PDTimes()
        self.prefill_attempts = prefill_attempts
        self._prefill_done = False  # the current prefill instance's part is accounted with the router
        self._spans = spans         # the request's trace: each prefill instance's part ends in it
        self.decoding = False       # the decode instance streams (its first chunk came): it runs the request
        self._stall = stall or StallLimits()

    async def __aiter__(self) -> AsyncIterator[engine_pb2.GenerateResponse]:
        p_iter, d_iter = self._watched_prefill(), self._d_iter
        watcher: asyncio.Future | None = None
        got_first = done = False
        try:
            first, p_iter = await self._first_token(p_iter)
            got_first = True
            done = first.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED
            yield first
            if done:  # the first token ended the request: nothing was handed off
                return
            # The prefill stream ends once the decode side confirmed the KV; that end waits for the
            # prefill instance's current step, so it is watched in the background while the decode
            # stream goes on (the next token must not wait for another request's prefill).
            watcher = self._placer.background(self._watch_handoff(p_iter))
            chunk = await self._first_decode(watcher)
            while True:
                done = chunk.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED
                yield chunk
                if done:
                    return
                chunk = await anext(d_iter)
        except StopAsyncIteration:
            raise InstanceUnavailableError(f"decode instance {self.decode.state.instance_id} ended the stream "
                                           "early", self.decode.state.instance_id) from None
        except GeneratorExit:
            if not done:
                self._metrics.cancelled_request(self._model)  # the client left between or during the phases
            raise
        finally:
            if watcher is None:
                self._finish_prefill(got_first)
            if watcher is None or not done:  # an early end: closing a call that is still open aborts its request
                if watcher is not None:
                    watcher.cancel()
                with contextlib.suppress(Exception):
                    await p_iter.aclose()
            with contextlib.suppress(Exception):
                await d_iter.aclose()

    def _watched_prefill(self) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """The current prefill instance's stream, broken off if that instance stops (:func:`watched`)."""
        return watched(aiter(self._p_stream), self.prefill.state, self._stall)

    def _finish_prefill(self, got_first: bool) -> None:
        """Account the end of the current prefill instance's part (once per instance tried)."""
        if not self._prefill_done:
            self._prefill_done = True
            self._router.finished(self.prefill, got_first)
            self._spans.left(self.prefill, None if got_first else "failed before the first token")

    async def _first_token(self, p_iter: AsyncIterator) -> tuple[engine_pb2.GenerateResponse, AsyncIterator]:
        """The prefill instance's first chunk; a prefill instance failing before it is replaced
        (the decode side's reservation waits). Returns the chunk and the stream it came from."""
        while True:
            try:
                chunk = await anext(p_iter)
                if chunk.finish_reason == HANDED_OFF:
                    raise InstanceUnavailableError(f"prefill instance {self.prefill.state.instance_id} handed "
                                                   "off before a token", self.prefill.state.instance_id)
            except (InstanceUnavailableError, StopAsyncIteration):
                self._router.failed(self.prefill.state)
                self._finish_prefill(False)
                with contextlib.suppress(Exception):
                    await p_iter.aclose()
                await self._retry_prefill()
                p_iter = self._watched_prefill()
                continue
            self._on_first_token(chunk)
            return chunk, p_iter

    async def _watch_handoff(self, p_iter: AsyncIterator) -> bool:
        """The rest of the prefill stream: whether it ended with the hand-off."""
        try:
            async for chunk in p_iter:
                if chunk.finish_reason == HANDED_OFF:
                    return True
            return False
        except InstanceUnavailableError:
            self._router.failed(self.prefill.state)
            return False
        except Exception as exc:  # an error chunk, a broken call: the decode side may still have the KV
            log.warning("request %s: the prefill stream ended with %s", self._req.request_id, exc)
            return False
        finally:
            self._finish_prefill(True)

    async def _first_decode(self, watcher: asyncio.Future) -> engine_pb2.GenerateResponse:
        """The decode instance's first chunk. If the prefill instance failed after the first token,
        the decode side has the KV only if that chunk comes within the grace period; otherwise the
        request is resumed elsewhere."""
        nxt = asyncio.ensure_future(anext(self._d_iter))
        try:
            await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done() and not watcher.result():
                await asyncio.wait({nxt}, timeout=self._grace)
                if not nxt.done():
                    self._metrics.handoff_lost(self._model)
                    raise InstanceUnavailableError(f"the KV hand-off from {self.prefill.state.instance_id} was "
                                                   "lost", self.prefill.state.instance_id)
            chunk = await nxt
        finally:
            nxt.cancel()
        self._on_decode_start(chunk)
        return chunk

    async def _retry_prefill(self) -> None:
        failed = self.prefill.state.instance_id
        if self.prefill_attempts >= MAX_PREFILL_ATTEMPTS:
            raise InstanceUnavailableError(f"prefill failed on {self.prefill_attempts} instances", failed)
        self._metrics.prefill_retry(self._model, failed)
        log.warning("request %s: prefill instance %s failed before the first token; retrying on another",
                    self._req.request_id, failed)
        self.prefill, self._p_stream, attempts = await self._placer.submit_prefill(
            self._model, self._req, self.target, self._session, exclude={failed}, spans=self._spans)
        self.prefill_attempts += attempts
        self._prefill_done = False
        self._router.dispatched(self.prefill, 1)

    def _on_first_token(self, chunk: engine_pb2.GenerateResponse) -> None:
        self.times.first_token = time.monotonic()
        # the prefill instance's part of the queue is done (its pending prefill drops now, not at the
        # hand-off's end), and its TTFT is one the role policy reads (dynamic PD)
        self._router.first_token(self.prefill, observe=False)
        self._router.observe_ttft(self.prefill.state, self.times.first_token - self.times.started)
        stats = chunk.disagg_stats
        self.times.queue, self.times.prefill = stats.queue_seconds, stats.prefill_seconds

    def _on_decode_start(self, chunk: engine_pb2.GenerateResponse) -> None:
        now = time.monotonic()
        self.decoding = True
        stats = chunk.disagg_stats
        t = self.times
        t.transfer = max(stats.transfer_seconds - stats.overlapped_seconds, 0.0)  # what the prefill did not hide
        t.first_decode = max((now - t.first_token) - t.transfer, 0.0) if t.first_token is not None else 0.0
        self._metrics.handoff(self._model, self.target.transport, stats)
        self._metrics.ttft_breakdown(self._model, t)
        log.info("request %s via %s -> %s: ttft %.3fs (queue %.3f, prefill %.3f); transfer %.3fs (%.3fs of it "
                 "during the prefill) of %d bytes over %s%s; first decode %.3fs", self._req.request_id,
                 self.prefill.state.instance_id, self.decode.state.instance_id, (t.first_token or now) - t.started,
                 t.queue, t.prefill, stats.transfer_seconds, stats.overlapped_seconds, stats.transfer_bytes,
                 self.target.transport, f" (failed: {stats.failure}; recomputed)" if stats.recomputed else "",
                 t.first_decode)
