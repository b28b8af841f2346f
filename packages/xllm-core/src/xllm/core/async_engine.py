"""Runs an :class:`LLMEngine` on its own thread and streams results to asyncio.

The HTTP event loop never runs model code: requests and aborts are queued to
the engine thread, which applies them between steps; each step's chunks are
handed back to the event loop in one ``call_soon_threadsafe`` per loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from xllm.core.compute_thread import ComputeThread
from xllm.core.engine import LLMEngine
from xllm.core.errors import EngineCrashedError, EngineDeadError, EngineOverloadedError
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.registry.v1 import instance_pb2

log = logging.getLogger(__name__)


class RequestStream:
    """The chunks of one request, in order; iteration ends after the final chunk.

    Leaving the iteration early (client gone) aborts the request in the engine.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        # one reader: a deque and the reader's future (an asyncio.Queue costs a few µs more per chunk, and
        # every engine step puts a chunk into each of up to max_num_seqs streams on the event loop)
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self.finished = False

    def _put(self, item: engine_pb2.GenerateResponse | BaseException) -> None:
        """Event loop thread only."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _get(self) -> engine_pb2.GenerateResponse | BaseException:
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    async def __aiter__(self) -> AsyncIterator[engine_pb2.GenerateResponse]:
        try:
            while True:
                item = await self._get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                if item.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                    self.finished = True
                yield item
                if self.finished:
                    return
        finally:
            if not self.finished:
                self._engine.abort(self.request_id)


class AsyncEngine:
    """Thread-backed engine front. ``submit`` validates synchronously."""

    def __init__(self, engine: LLMEngine, idle_wait: float = 0.05, compute: ComputeThread | None = None) -> None:
        """``compute``: the thread the engine was loaded and built on. The loop runs there (or, with
        async scheduling, on a thread of its own while the engine's forwards run there)."""
        self.engine = engine
        self._compute = compute
        self._loop_future: Future | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._idle_wait = idle_wait
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dead_reason: str | None = None
        self.crashed = False  # the loop died of an exception (not a shutdown)
        self._closing = threading.Lock()  # orders submit() against the loop's end
        self._busy_since: float | None = None  # monotonic start of the step running now

    # ---- lifecycle --------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None or self._loop_future is not None:
            return
        if self._compute is not None and not self.engine.config.async_scheduling:
            self._loop_future = self._compute.submit(self._run)
            return
        self._thread = threading.Thread(target=self._run, name="xllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._loop_future is not None:
            with contextlib.suppress(TimeoutError):
                self._loop_future.result(timeout)
            self._loop_future = None

    @property
    def is_running(self) -> bool:
        alive = (self._thread is not None and self._thread.is_alive()) or \
            (self._loop_future is not None and not self._loop_future.done())
        return alive and self.dead_reason is None

    # ---- requests ---------------------------------------------------------
    def submit(self, req: engine_pb2.GenerateRequest) -> RequestStream:
        """Queue ``req``; raises InvalidRequestError / EngineOverloadedError / EngineDeadError now."""
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        self.engine.validate(req)
        if len(self.engine.scheduler.waiting) + self._commands.qsize() >= self.engine.config.max_waiting_requests:
            raise EngineOverloadedError("too many requests waiting; retry later")
        stream = RequestStream(self, req.request_id, asyncio.get_running_loop())
        with self._closing:  # never queued after the loop's last look at its commands
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            self._commands.put(("add", req, stream))
        self._wake.set()
        return stream

    async def submit_async(self, req: engine_pb2.GenerateRequest) -> RequestStream:
        """:meth:`submit` from an event loop: an output constraint is compiled on a worker thread
        first (into the engine's grammar cache; milliseconds for a large schema), never on the loop."""
        grammars = self.engine.grammars
        if req.sampling.HasField("structured") and grammars is not None:
            await asyncio.to_thread(grammars.compile, req.sampling.structured)
        return self.submit(req)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))
        self._wake.set()

    def execute(self, fn: Callable[[LLMEngine], list[engine_pb2.GenerateResponse] | None]) -> asyncio.Future:
        """Run ``fn(engine)`` on the engine thread between steps; chunks it returns (a list) are
        delivered to their streams. The returned future (of the caller's loop) resolves to ``fn``'s result."""
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", fn, future))
        self._wake.set()
        return future

    def load_report(self) -> instance_pb2.LoadReport:
        return self.engine.load_report()

    # ---- engine thread ----------------------------------------------------
    def stalled_for(self) -> float:
        """Seconds the loop has had work without finishing an iteration (0 while idle or moving):
        a step that never returns shows here while heartbeats keep flowing."""
        busy_since = self._busy_since
        return 0.0 if busy_since is None else time.monotonic() - busy_since

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._busy_since = None
                self._drain_commands()
                if not self.engine.has_work():
                    self._wake.wait(self._idle_wait)
                    self._wake.clear()
                    continue
                self._busy_since = time.monotonic()
                self._deliver(self.engine.step())
                if self.engine.stalled:  # nothing could run (e.g. KV held by hand-offs): wait for a change
                    self._wake.wait(self._idle_wait)
                    self._wake.clear()
        except Exception as exc:  # the engine is unusable: fail every stream loudly
            suspects = self.engine.stepping_request_ids()
            log.exception("engine loop crashed (requests in the failing step: %s)", sorted(suspects))
            self.dead_reason = f"engine loop crashed: {type(exc).__name__}"
            self.crashed = True
            reason = self.dead_reason
            self._fail_streams(lambda rid: EngineCrashedError(reason, suspect=rid in suspects))
        finally:
            with self._closing:
                if self.dead_reason is None:
                    self.dead_reason = "engine shut down"
            never_ran = EngineCrashedError(self.dead_reason, suspect=False) if self.crashed else \
                EngineDeadError(self.dead_reason)
            self._fail_queued(never_ran)
            self._fail_streams(lambda _rid: never_ran)

    def _fail_queued(self, err: BaseException) -> None:
        """Requests queued while the loop stopped: they get the error (they would wait forever)."""
        while True:
            try:
                kind, _payload, stream = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                _post(stream, err)
            elif kind == "call":
                with contextlib.suppress(RuntimeError):
                    stream.get_loop().call_soon_threadsafe(_settle, stream, None, err)

    def _drain_commands(self) -> None:
        out: list[engine_pb2.GenerateResponse] = []
        while True:
            try:
                kind, payload, stream = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                try:
                    ready = self.engine.add_request(payload)
                    self._streams[payload.request_id] = stream
                    out.extend(ready)
                except Exception as exc:  # validation raced with another request: report to the caller
                    _post(stream, exc)
            elif kind == "call":
                _call_on_engine(self.engine, payload, stream, out)
            else:
                final = self.engine.abort(payload)
                if final is not None:
                    out.append(final)
        if out:
            self._deliver(out)

    def _deliver(self, chunks: list[engine_pb2.GenerateResponse]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for chunk in chunks:
            stream = self._streams.get(chunk.request_id)
            if stream is None:
                continue
            if chunk.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                del self._streams[chunk.request_id]
            by_loop[stream._loop].append((stream, chunk))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed event loop: its clients are gone
                loop.call_soon_threadsafe(_dispatch, items)

    def _fail_streams(self, error_for: Callable[[str], BaseException]) -> None:
        """End every open stream with ``error_for(request_id)``."""
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            _post(stream, error_for(rid))


def _post(stream: RequestStream, err: BaseException) -> None:
    """Hand ``err`` to ``stream`` on its event loop (a closed loop: its client is gone)."""
    with contextlib.suppress(RuntimeError):
        stream._loop.call_soon_threadsafe(stream._put, err)


def _call_on_engine(engine: LLMEngine, fn, future: asyncio.Future, out: list) -> None:
    loop = future.get_loop()
    try:
        result = fn(engine)
    except Exception as exc:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, future, None, exc)
        return
    if isinstance(result, list):  # chunks to deliver
        out.extend(result)
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_settle, future, result, None)


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _dispatch(items: list) -> None:
    for stream, chunk in items:
        stream._put(chunk)
