"""Runs an :class:`LLMEngine` on its own thread and streams results to asyncio.

The HTTP event loop never runs model code: requests and aborts are queued to
the engine thread, which applies them between steps; each step's chunks are
handed back to the event loop in one ``call_soon_threadsafe`` per loop.

:class:`AsyncEngine` is also the one handle through which the engine service (``xllm.engine``:
its server, hand-offs and migrations) drives the core, as vLLM's ``EngineCoreClient`` utility
methods do: typed commands queued to the engine thread like requests and run between steps
(``install_kv``, ``release_kv``, ``move_snapshot``, ``pause_for_move``), the service's sides
attached through typed registrations (``attach_disagg`` with a
:class:`~xllm.core.disagg.DisaggListener`, ``add_observer`` with a
:class:`~xllm.engine_api.stats.StatsObserver`, ``enable_kv_events``), and read-only facts (the KV
layout and pages, the tiers below with their stats and events, the prefix cache's events, the
prefill work queued). The KV is seen there through its
:class:`~xllm.core.kv.contracts.KVTransfer` contract only.
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
from typing import TYPE_CHECKING, TypeVar

from xllm.core.compute_thread import ComputeThread
from xllm.core.disagg import DisaggListener, MoveSnapshot
from xllm.core.embedding import EncodeQueue
from xllm.core.engine import LLMEngine
from xllm.core.engine_weights import ModelSleepingError
from xllm.engine_api.errors import EngineCrashedError, EngineDeadError, EngineOverloadedError
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.registry.v1 import instance_pb2

if TYPE_CHECKING:
    from xllm.core.kv.contracts import KVTransfer
    from xllm.core.kv.layout import KVCacheLayout
    from xllm.core.kv.lower_tiers import LowerTiers
    from xllm.core.kv.page_store import PageAccess
    from xllm.core.request_trace import RequestTrace
    from xllm.core.validation import RequestLimits
    from xllm.engine_api.stats import StatsObserver
    from xllm.kvstore.tier import TierStats

log = logging.getLogger(__name__)
T = TypeVar("T")


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
    """Thread-backed engine front, and the engine service's handle on the core (see the module
    docstring). ``submit`` validates synchronously."""

    def __init__(self, engine: LLMEngine, idle_wait: float = 0.05, compute: ComputeThread | None = None) -> None:
        """``compute``: the thread the engine was loaded and built on. The loop runs there (or, with
        async scheduling, on a thread of its own while the engine's forwards run there)."""
        self._engine = engine
        self._kv: KVTransfer = engine.kv
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
        self.hung = False  # the step watchdog took it for hung (declare_hung): a step may still hold the engine
        self._closing = threading.Lock()  # orders submit() against the loop's end
        self._busy_since: float | None = None  # monotonic start of the step running now
        self.steps_done = 0  # steps the loop completed (the step watchdog's sign of progress)
        self.longest_step = 0.0  # seconds, the longest of them as stalled_for() saw it (the watchdog's margin)
        # weight commands (sleep, wake_up, update_weights) waiting for the engine to drain, in order, and the
        # requests that arrived meanwhile (held outside the engine; run once the commands ran)
        self._barriers: deque[tuple[Callable[[LLMEngine], object], asyncio.Future]] = deque()
        self._held: list[tuple[tuple, RequestStream]] = []
        self._encodes = EncodeQueue()  # Encode calls waiting for their batch

    # ---- lifecycle --------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None or self._loop_future is not None:
            return
        if self._compute is not None and not self._engine.config.async_scheduling:
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
    def submit(self, req: engine_pb2.GenerateRequest, trace: RequestTrace | None = None) -> RequestStream:
        """Queue ``req``; raises InvalidRequestError / EngineOverloadedError / EngineDeadError now. ``trace``:
        the request's record, filled by the engine thread (:mod:`xllm.core.request_trace`); read it once the
        stream ended."""
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        if self._engine.weights.level:
            raise ModelSleepingError(self._engine.weights.level)
        self._engine.validate(req)
        waiting = len(self._engine.scheduler.waiting) + self._commands.qsize() + len(self._held)
        if waiting >= self._engine.config.max_waiting_requests:
            raise EngineOverloadedError("too many requests waiting; retry later")
        stream = RequestStream(self, req.request_id, asyncio.get_running_loop())
        with self._closing:  # never queued after the loop's last look at its commands
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            self._commands.put(("add", (req, trace), stream))
        self._wake.set()
        return stream

    async def submit_async(self, req: engine_pb2.GenerateRequest, trace: RequestTrace | None = None) -> RequestStream:
        """:meth:`submit` from an event loop: an output constraint is compiled on a worker thread
        first (into the engine's grammar cache; milliseconds for a large schema), never on the loop."""
        grammars = self._engine.grammars
        if req.sampling.HasField("structured") and grammars is not None:
            self._engine.limits.check(req)  # the cheap checks (sizes, ranges) before the costly compile
            await asyncio.to_thread(grammars.compile, req.sampling.structured)
        return self.submit(req, trace)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))
        self._wake.set()

    def load_report(self) -> instance_pb2.LoadReport:
        return self._engine.load_report()

    # ---- the engine service's handle: typed commands, run on the engine thread between steps ----------
    # Each is queued at once (in call order with submit and abort) and returns a future of the caller's
    # loop; chunks a command produces go to their streams as a step's do.
    def install_kv(self, commit: engine_pb2.KVCommit, received: bool = True
                   ) -> asyncio.Future[list[engine_pb2.GenerateResponse]]:
        """Decode side of a hand-off (or a migration's destination): the reserved pages hold the KV
        ``commit`` names (``received``), or its transfer failed and the engine computes what it lacks
        (:meth:`LLMEngine.install_kv <xllm.core.engine_moves.EngineMoves.install_kv>`). Resolves to the
        chunks it produced (only if the request ended right there)."""
        return self._call(lambda e: e.install_kv(commit, received=received))

    def release_kv(self, request_id: str) -> asyncio.Future[list[engine_pb2.GenerateResponse]]:
        """A hand-off or migration of ``request_id`` is over: its KV is freed, its stream ends
        (handed off), or an unused reservation is dropped (:meth:`LLMEngine.release_kv
        <xllm.core.engine_moves.EngineMoves.release_kv>`). Resolves to the chunks it produced."""
        return self._call(lambda e: e.release_kv(request_id))

    def move_snapshot(self, request_id: str) -> asyncio.Future[MoveSnapshot | None]:
        """Migration source: the KV the running request holds now (None: not running here)."""
        return self._call(lambda e: e.move_snapshot(request_id))

    def pause_for_move(self, request_id: str) -> asyncio.Future[bool]:
        """Migration source: stop scheduling the running request and keep its KV; the hand-off
        side hears :class:`~xllm.core.disagg.MoveReady` once no step in flight computes it. False if
        it is not running here."""
        return self._call(lambda e: e.pause_for_move(request_id))

    def load_lora(self, name: str, path: str | None) -> asyncio.Future[int]:
        """Register the PEFT LoRA adapter in directory ``path`` as model ``name`` (:meth:`LLMEngine.load_lora
        <xllm.core.lora.EngineLora.load_lora>`: ``InvalidRequestError`` naming ``lora_name`` or ``lora_path``),
        resolving to its KV hash root; ``path`` None unloads ``name`` instead (resolving to 0;
        ``InvalidRequestError`` while requests in flight use it)."""
        return self._call(lambda e: e.load_lora(name, path) if path is not None else e.unload_lora(name) or 0)

    def embed(self, prompt: list[int], pooling: str, normalize: bool) -> asyncio.Future[tuple[float, ...]]:
        """The pooled final hidden state of ``prompt`` (:meth:`LLMEngine.embed`), computed between steps."""
        return self._call(lambda e: e.embed(prompt, pooling, normalize))

    def encode_images(self, images: list[engine_pb2.ImageInput]
                      ) -> asyncio.Future[tuple[engine_pb2.ImageEmbedding, ...]]:
        """The images' embeddings (``EngineService.Encode``), computed between steps with the other calls queued
        by then, in one batch bounded while requests run (:class:`~xllm.core.embedding.EncodeQueue`)."""
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("encode", list(images), future))
        self._wake.set()
        return future

    # ---- weight commands: run once the engine drained (running and queued requests finished; requests that
    # arrive meanwhile wait outside the engine and run afterwards, or are refused if it then sleeps) ----------
    def sleep(self, level: int) -> asyncio.Future[int]:
        """Drain, then sleep at ``level`` (:meth:`LLMEngine.sleep <xllm.core.engine_weights.EngineWeights.sleep>`:
        1 frees the KV memory and prefix cache, 2 the weights too); resolves to the level it sleeps at. From then
        on :meth:`submit` raises :class:`ModelSleepingError` (as do requests that arrived while it drained)."""
        return self._barrier(lambda e: e.sleep(level))

    def wake_up(self) -> asyncio.Future[int]:
        """Wake (after the commands queued before it); resolves to the level it slept at (0: it was awake)."""
        return self._barrier(lambda e: e.wake_up())

    def update_weights(self, path: str) -> asyncio.Future[str]:
        """Drain, then read the safetensors weights in ``path`` in place (:meth:`LLMEngine.update_weights
        <xllm.core.engine_weights.EngineWeights.update_weights>`); resolves to the new KV identity, or fails with
        ``InvalidRequestError`` naming ``model_path`` (the old weights serve on). Requests that arrive while it
        drains or reads run afterwards, on the new weights."""
        return self._barrier(lambda e: e.update_weights(path))

    def is_sleeping(self) -> int:
        """0 awake, else the level the engine sleeps at (any thread)."""
        return self._engine.weights.level

    def _barrier(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("barrier", fn, future))
        self._wake.set()
        return future

    def _pass_barriers(self, out: list[engine_pb2.GenerateResponse]) -> None:
        """The engine drained: run the waiting weight commands in order, then the held requests (refused with
        :class:`ModelSleepingError` if the engine now sleeps)."""
        while self._barriers:
            fn, future = self._barriers.popleft()
            _call_on_engine(self._engine, fn, future, out)
        held, self._held = self._held, []
        level = self._engine.weights.level
        for payload, stream in held:
            if level:
                _post(stream, ModelSleepingError(level))
                continue
            try:
                out.extend(self._engine.add_request(*payload))
                self._streams[payload[0].request_id] = stream
            except Exception as exc:
                _post(stream, exc)

    def _call(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps; chunks it returns (a list) are
        delivered to their streams. The returned future (of the caller's loop) resolves to ``fn``'s result."""
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", fn, future))
        self._wake.set()
        return future

    # ---- the engine service's handle: attaching its sides -------------------------------------------
    def attach_disagg(self, listener: DisaggListener) -> None:
        """Serve prefill/decode hand-offs and migrations, reporting them to ``listener``."""
        self._engine.attach_disagg(listener)

    def add_observer(self, observer: StatsObserver) -> None:
        """Tell ``observer`` about every step (on the engine thread; add it before :meth:`start` to
        hear every one)."""
        self._engine.add_observer(observer)

    def enable_kv_events(self) -> None:
        """Keep the prefix cache's events from now on, for :meth:`drain_kv_events` (whoever asks
        must drain them regularly: they are kept until drained)."""
        self._kv.enable_events()

    # ---- the engine service's handle: facts (read-only) ---------------------------------------------
    @property
    def instance_id(self) -> str:
        return self._engine.instance_id

    @property
    def request_limits(self) -> RequestLimits:
        """What a request may ask of this engine (context length, KV capacity, the request bounds);
        immutable (the engine service sizes its messages by it)."""
        return self._engine.limits

    @property
    def kv_layout(self) -> KVCacheLayout:
        """The KV memory's sizes (block size, layers, the ``fingerprint`` peers must share)."""
        return self._engine.transfer_layout

    def page_store(self) -> PageAccess | None:
        """The KV pages as bytes, what hand-off transports read and write (None: a backend without
        pages, which cannot hand KV off). A tensor-parallel instance's: every rank's KV heads, in
        :attr:`kv_layout`."""
        return self._engine.transfer_store()

    @property
    def lower_tiers(self) -> LowerTiers | None:
        """The KV tiers below the engine's memory (hand-offs through the cluster store use them), or None."""
        return self._kv.lower_tiers

    def tier_stats(self) -> dict[str, TierStats]:
        """Per lower KV tier its stats (any thread)."""
        return self._kv.tier_stats()

    def drain_tier_events(self) -> list[tuple[str, bool, int]]:
        """``(tier, stored?, block hash)``: blocks that became loadable from, or left, a lower tier
        since the last call (any thread: the tiers' store is thread-safe)."""
        return self._kv.drain_tier_events()

    def drain_kv_events(self) -> list[tuple[bool, int]]:
        """The prefix cache's events ``(stored?, block hash)`` since the last call, after
        :meth:`enable_kv_events` (engine thread: from a step observer)."""
        return self._kv.drain_events()

    def pending_prefill_tokens(self) -> tuple[int, int]:
        """Prompt tokens still to compute (queued requests and running ones mid-prefill) and the
        offline share of them (engine thread: from a step observer)."""
        return self._engine.scheduler.pending_prefill_tokens()

    # ---- engine thread ----------------------------------------------------
    def stalled_for(self) -> float:
        """Seconds the loop has had work without finishing an iteration (0 while idle or moving):
        a step that never returns shows here while heartbeats keep flowing."""
        busy_since = self._busy_since
        return 0.0 if busy_since is None else time.monotonic() - busy_since

    def declare_hung(self, reason: str) -> bool:
        """The step watchdog's verdict (any thread): the engine thread is stuck in a step, so the engine
        is dead from now on, as if its loop had crashed: :meth:`submit` refuses, every open stream
        and queued request fails with :class:`EngineCrashedError` (``suspect``: the request is in the
        stuck step) and the loop, should the step ever return, ends without stepping again. False if
        the engine was already dead."""
        with self._closing:
            if self.dead_reason is not None:
                return False
            self.dead_reason = reason
            self.crashed = self.hung = True
        self._stop.set()
        self._wake.set()
        try:
            suspects = self._engine.stepping_request_ids()
        except RuntimeError:  # the step changed them as they were read: it is not stuck after all, but too slow
            suspects = set()
        log.error("engine hung (%s; requests in the stuck step: %s)", reason, sorted(suspects))
        self._fail_queued(EngineCrashedError(reason, suspect=False))
        self._fail_streams(lambda rid: EngineCrashedError(reason, suspect=rid in suspects))
        return True

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._busy_since = None
                self._drain_commands()
                if not self._engine.has_work():
                    self._wake.wait(self._idle_wait)
                    self._wake.clear()
                    continue
                self._busy_since = time.monotonic()
                self._deliver(self._engine.step())
                self.steps_done += 1
                self.longest_step = max(self.longest_step, time.monotonic() - self._busy_since)
                if self._engine.stalled:  # nothing could run (e.g. KV held by hand-offs): wait for a change
                    self._wake.wait(self._idle_wait)
                    self._wake.clear()
        except Exception as exc:  # the engine is unusable: fail every stream loudly
            suspects = self._engine.stepping_request_ids()
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
        held, self._held = self._held, []
        for _payload, stream in held:
            _post(stream, err)
        while self._barriers:
            _fn, future = self._barriers.popleft()
            with contextlib.suppress(RuntimeError):
                future.get_loop().call_soon_threadsafe(_settle, future, None, err)
        for future in self._encodes.drain():
            with contextlib.suppress(RuntimeError):
                future.get_loop().call_soon_threadsafe(_settle, future, None, err)
        while True:
            try:
                kind, _payload, stream = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                _post(stream, err)
            elif kind in ("call", "barrier", "encode"):
                with contextlib.suppress(RuntimeError):
                    stream.get_loop().call_soon_threadsafe(_settle, stream, None, err)

    def _drain_commands(self) -> None:
        out: list[engine_pb2.GenerateResponse] = []
        while True:
            try:
                kind, payload, stream = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add" and self._barriers:  # a weight command waits for the engine to drain
                self._held.append((payload, stream))
            elif kind == "barrier":
                self._barriers.append((payload, stream))
            elif kind == "add":
                try:
                    ready = self._engine.add_request(*payload)
                    self._streams[payload[0].request_id] = stream
                    out.extend(ready)
                except Exception as exc:  # validation raced with another request: report to the caller
                    _post(stream, exc)
            elif kind == "call":
                _call_on_engine(self._engine, payload, stream, out)
            elif kind == "encode":
                self._encodes.put(payload, stream)
            else:
                self._held = [(p, st) for p, st in self._held if p[0].request_id != payload]
                final = self._engine.abort(payload)
                if final is not None:
                    out.append(final)
        if self._encodes:
            self._run_encodes()
        if self._barriers and not self._engine.has_work():
            self._pass_barriers(out)
        if out:
            self._deliver(out)

    def _run_encodes(self) -> None:
        """One batch of the waiting ``Encode`` calls; each caller gets its embeddings or its refusal."""
        batch = self._encodes.take(self._engine.has_work(), self._engine.max_encode_images)
        try:
            results = self._engine.encode_requests([images for images, _ in batch])
        except Exception as exc:  # the vision tower failed: every call of the batch fails with it
            results = [exc] * len(batch)
        for (_, future), got in zip(batch, results, strict=True):
            failed = got if isinstance(got, Exception) else None
            with contextlib.suppress(RuntimeError):
                future.get_loop().call_soon_threadsafe(_settle, future, None if failed else got, failed)
        if self._encodes:
            self._wake.set()  # more calls wait: the next loop turn runs them (after a step, if requests run)

    def _deliver(self, chunks: list[engine_pb2.GenerateResponse]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for chunk in chunks:
            stream = self._streams.get(chunk.request_id)
            if stream is None:
                continue
            if chunk.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                self._streams.pop(chunk.request_id, None)  # (the watchdog may have failed them all meanwhile)
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
