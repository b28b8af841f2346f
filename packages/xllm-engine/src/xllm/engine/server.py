"""The server side of ``xllm.engine.v1.EngineService``: :class:`EngineServer` over an :class:`AsyncEngine`.

One engine instance per process in a cluster. The server

- bounds its intake (:mod:`xllm.engine.intake`): a request message larger than its kind can need
  under this engine's limits (context length, the request bounds of :mod:`xllm.engine_api.bounds`,
  KV page sizes) is refused with ``RESOURCE_EXHAUSTED`` before it is parsed, and request validation
  (:mod:`xllm.core.validation`) applies the gateway's request limits again, cheapest checks first;
- streams ``Generate`` chunks as the engine produces them. A request is validated and queued
  before anything is sent: a rejected one ends with a status and no message; an accepted one
  first sends the initial metadata ``xllm-accepted: 1`` (statuses and keys: :mod:`xllm.engine_api.wire`);
- serves ``Abort``, ``Health``, ``GetLoad`` and ``GetKVEvents``;
- keeps the instance's prefix-cache events as versioned deltas (:class:`~xllm.kvstore.KVEventLog`)
  and builds the registry ``Heartbeat`` (load, KV delta, counters) for whoever publishes it;
- shuts down gracefully: :meth:`EngineServer.drain` refuses new requests, lets the running ones
  finish and, when the drain time is up, hands the rest back to their callers (status
  UNAVAILABLE with the trailing metadata ``xllm-handed-back: 1``) so a gateway can resume them on
  another instance;
- serves either side of a prefill/decode hand-off (:mod:`xllm.engine.handoff`): a decode-phase
  request's first message is its KV reservation (``kv_reservation``), a prefill-phase request's
  stream ends with ``FINISH_REASON_HANDED_OFF`` once its KV went to the decode instance, and
  ``TransferKV`` receives KV over gRPC (and the commits of hand-offs through the KV store). The chunk
  after a hand-off on either side carries its ``disagg_stats``;
- moves running requests off a draining instance: to a caller that marked its request ``movable``
  (a gateway) the stream carries one ``move_offer`` (the KV's size against this instance's prefill
  speed) once the request decodes; the caller either resumes it elsewhere by recompute (closing
  this call) or reserves KV on another instance and asks ``Migrate``
  (:mod:`xllm.engine.handoff.migration`), after which the stream ends with
  ``FINISH_REASON_HANDED_OFF``; a move that fails hands the request back.

The server drives the engine through its handle, the :class:`~xllm.core.AsyncEngine` (typed
commands and read-only facts; it never reaches into the core). KV events are drained from the
engine on its own thread: the server is a :class:`~xllm.engine_api.stats.StatsObserver` of the
engine (``AsyncEngine.add_observer``), and after every step it moves ``AsyncEngine.drain_kv_events()``
into a thread-safe queue; the event loop numbers them. The same hook measures prefill speed and
the queued prefill work (``AsyncEngine.pending_prefill_tokens()``) for the load report.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field, replace

import grpc

from xllm.core import AsyncEngine
from xllm.core.watchdog import StepWatchdog
from xllm.engine.detached import DetachedRequests, ReattachRefused
from xllm.engine.handoff import grpc as grpc_transport
from xllm.engine.handoff.base import HandoffOptions
from xllm.engine.handoff.manager import HandoffManager
from xllm.engine.inprocess import control_answer, embed_answer, encode_answer, load_lora_answer
from xllm.engine.intake import Intake, message_bounds
from xllm.engine.tracing import EngineTracer
from xllm.engine_api.credential import prove_mac
from xllm.engine_api.errors import EngineError
from xllm.engine_api.logs import REQUEST_ID
from xllm.engine_api.security import NO_SECURITY, ClusterSecurity, bind, new_server
from xllm.engine_api.stats import StepStats
from xllm.engine_api.tracing import Tracing
from xllm.engine_api.wire import ACCEPTED_KEY, DRAINING, HANDED_BACK, RequestFailedError, Status, status_for
from xllm.kvstore import KVEventLog
from xllm.proto.engine.v1 import engine_pb2, engine_pb2_grpc
from xllm.proto.kvstore.v1 import kv_events_pb2
from xllm.proto.registry.v1 import instance_pb2

log = logging.getLogger(__name__)

@dataclass
class _Call:
    request_id: str
    movable: bool = False   # the caller answers move offers
    offered: bool = False
    num_tokens: int = 0     # prompt and output tokens streamed so far
    handed_back: bool = False
    aborted: bool = False   # an explicit Abort: a broken call then does not detach the request
    history: list[engine_pb2.GenerateResponse] = field(default_factory=list)  # chunks sent (detaching on)


class _Observer:
    """Runs on the engine thread after every step (see the module docstring)."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server

    def on_step(self, s: StepStats) -> None:
        self.server._on_step(s)


class EngineServer(engine_pb2_grpc.EngineServiceServicer):
    """Serves one :class:`AsyncEngine` over gRPC (start it with :meth:`start`).

    ``security``: the cluster token and TLS the service requires, and its KV hand-offs to other
    instances present (:mod:`xllm.engine_api.security`). ``stall_timeout``: the step watchdog's
    floor (0: no watchdog; :class:`xllm.core.watchdog.StepWatchdog`): an engine taken for hung fails
    its streams as in a crash, which gateways resume elsewhere; its health and heartbeats say why, and
    the instance process deregisters and stops."""

    def __init__(self, engine: AsyncEngine, kv_history: int = 1 << 16, rate_alpha: float = 0.2,
                 handoff: HandoffOptions | None = None, security: ClusterSecurity = NO_SECURITY,
                 stall_timeout: float = 60.0, detached_grace_s: float = 0.0, tracing: Tracing | None = None) -> None:
        self.engine = engine
        self.security = security
        self.watchdog = StepWatchdog(engine, stall_timeout)
        self.detached = DetachedRequests(detached_grace_s, engine.abort)  # calls broken without an Abort
        self.tracer = EngineTracer(tracing or Tracing(), engine.instance_id)  # spans of traced callers' requests
        self.instance_id = engine.instance_id
        self.block_size = engine.kv_layout.block_size
        engine.enable_kv_events()  # published from now on (drained after every step, see _on_step)
        self.kv_log = KVEventLog(self.instance_id, self.block_size, max_history=kv_history)
        self._raw_events: collections.deque[tuple[bool, int]] = collections.deque()
        tiers = engine.lower_tiers
        self.kv_log.tier_scopes = tiers.scopes() if tiers is not None else {}  # who shares each tier's storage
        self._rate_alpha = rate_alpha
        self.prefill_tokens_per_s = 0.0
        self.pending_prefill_tokens = 0
        self.offline_pending_prefill_tokens = 0
        self._counts = {f.name: 0 for f in instance_pb2.EngineCounters.DESCRIPTOR.fields
                        if f.name != "spec_decode_num_accepted_tokens_per_pos"}
        self._spec_per_pos: list[int] = []  # EngineCounters.spec_decode_num_accepted_tokens_per_pos
        self.draining = False
        self._calls: dict[str, _Call] = {}
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.address = ""
        handoff = handoff or HandoffOptions()
        handoff = replace(handoff, transport_options={**handoff.transport_options, "security": security})
        self.handoff = HandoffManager(engine, handoff, self.count, self._hand_back)
        store = self.handoff.store  # message size bounds of each call kind (xllm.engine.intake)
        self.intake = Intake(message_bounds(engine.request_limits, store.page_bytes if store is not None else ()))
        engine.add_observer(_Observer(self))

    # ---- engine thread ------------------------------------------------------------------------
    def _on_step(self, s: StepStats) -> None:
        self._raw_events.extend(self.engine.drain_kv_events())
        c = self._counts
        c["prompt_tokens"] += s.prompt_tokens
        c["generation_tokens"] += len(s.ttfts) + len(s.inter_token_latencies)
        c["finished_requests"] += len(s.finished)
        c["preemptions"] += s.num_preempted
        c["prefix_cache_queries"] += s.prefix_cache_queries
        c["prefix_cache_hits"] += s.prefix_cache_hits
        c["offline_requests"] += s.offline.finished
        c["offline_prompt_tokens"] += s.offline.prompt_tokens
        c["offline_generation_tokens"] += s.offline.generation_tokens
        for reason, n in s.offline.preempted.items():
            c[f"offline_preemptions_{reason}"] += n
        c["spec_decode_num_drafts"] += s.spec_num_drafts
        c["spec_decode_num_draft_tokens"] += s.spec_draft_tokens
        c["spec_decode_num_accepted_tokens"] += s.spec_accepted_tokens
        c["beam_steps"] += s.beam_steps
        c["beam_rows"] += s.beam_rows
        c["beam_candidates_scanned"] += s.beam_candidates_scanned
        c["beam_early_terminations"] += s.beam_early_terminations
        c["images_encoded"] += s.images_encoded
        c["image_cache_hits"] += s.image_cache_hits
        c["image_encode_seconds"] += s.image_encode_seconds
        self._spec_per_pos.extend([0] * (len(s.spec_accepted_per_pos) - len(self._spec_per_pos)))
        for j, n in enumerate(s.spec_accepted_per_pos):
            self._spec_per_pos[j] += n
        if s.batch_size:
            c["steps"] += 1
        if s.num_prefill_tokens and s.step_time > 0:
            rate = s.num_prefill_tokens / s.step_time
            a = self._rate_alpha
            self.prefill_tokens_per_s = rate if self.prefill_tokens_per_s == 0 else (
                (1 - a) * self.prefill_tokens_per_s + a * rate)
        self.pending_prefill_tokens, self.offline_pending_prefill_tokens = self.engine.pending_prefill_tokens()

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None) -> int:
        """Bind ``host:port`` (0: a free port) and start serving; returns the bound port. ``advertise``:
        the address other instances reach this one at (for KV hand-offs), if not ``host:port``."""
        server = new_server(self.security, self.intake.bounds.server_options())
        self.intake.register(self, server)  # every request deserializer bounded by its kind's size
        bound = bind(server, host, port, self.security, "the engine service (--host)")
        await server.start()
        self._server, self.port = server, bound
        self.address = advertise or f"{host}:{bound}"  # as registered: what Prove answers for
        await self.handoff.start(self.address)
        self.watchdog.start()
        log.info("engine %s serving EngineService on %s:%d", self.instance_id, host, bound)
        return bound

    async def drain(self, timeout: float) -> int:
        """Refuse new requests, wait up to ``timeout`` s for the running ones (those of callers that
        move requests get move offers), hand back the rest.

        Returns how many requests were handed back.
        """
        self.begin_drain()
        deadline = time.monotonic() + timeout
        while self._calls and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._calls.values())
        for call in left:
            call.handed_back = True
            self.engine.abort(call.request_id)
        if left:
            log.warning("engine %s: drain time is up; handing %d request(s) back", self.instance_id, len(left))
            deadline = time.monotonic() + 5.0
            while self._calls and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        return len(left)

    def begin_drain(self) -> None:
        """Refuse new requests from now on; heartbeats say the instance drains (see :meth:`drain`)."""
        self.draining = True

    def _hand_back(self, request_id: str) -> None:
        """End a request's call as handed back (its caller resumes it elsewhere)."""
        call = self._calls.get(request_id)
        if call is not None:
            call.handed_back = True
            self.engine.abort(request_id)

    def _move_offer(self, call: _Call, request: engine_pb2.GenerateRequest,
                    chunk: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse | None:
        """The offer to move a request off this draining instance, once it decodes (None: not now)."""
        call.num_tokens += len(chunk.token_ids)
        if not (self.draining and call.movable and not call.offered and chunk.token_ids and self.handoff.enabled
                and request.disagg_phase != engine_pb2.DISAGG_PHASE_PREFILL):
            return None
        call.offered = True
        blocks = -(-call.num_tokens // self.block_size)
        return engine_pb2.GenerateResponse(request_id=call.request_id, move_offer=engine_pb2.MoveOffer(
            num_tokens=call.num_tokens, kv_bytes=blocks * self.handoff.store.block_bytes,
            prefill_tokens_per_s=self.prefill_tokens_per_s))

    async def stop(self, grace: float | None = 1.0) -> None:
        self.watchdog.stop()
        await self.detached.stop()
        await self.handoff.stop()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    @property
    def num_inflight(self) -> int:
        return len(self._calls)

    # ---- reports ------------------------------------------------------------------------------
    def _collect_events(self) -> None:
        batch = []
        while self._raw_events:
            batch.append(self._raw_events.popleft())
        if batch:
            self.kv_log.record(batch)
        # lower KV tiers, from their content at start (a host tier outliving the last process) on: they change
        # off the engine thread too (write-down, loads, hand-offs through the store), so they are drained
        # here, on the one thread that records
        self.kv_log.record_tiers(self.engine.drain_tier_events())

    def count(self, counter: str, n: int = 1) -> None:
        """Advance one of the cumulative counters of the heartbeats (``EngineCounters`` field names)."""
        self._counts[counter] += n

    def counters(self) -> instance_pb2.EngineCounters:
        """Cumulative counters since the server started."""
        return instance_pb2.EngineCounters(**self._counts, spec_decode_num_accepted_tokens_per_pos=self._spec_per_pos)

    def load_report(self) -> instance_pb2.LoadReport:
        report = self.engine.load_report()
        report.pending_prefill_tokens = self.pending_prefill_tokens
        report.offline_pending_prefill_tokens = self.offline_pending_prefill_tokens
        report.prefill_tokens_per_s = self.prefill_tokens_per_s
        return report

    def kv_events(self, since: int | None, epoch: int | None = None) -> kv_events_pb2.KVCacheEvents:
        """KV changes since ``since`` (a delta) or everything (``since=None``: a snapshot)."""
        self._collect_events()
        return self.kv_log.delta(since, epoch)

    def heartbeat(self, kv_since: int | None, seq: int = 0) -> instance_pb2.Heartbeat:
        """The registry heartbeat: load, the KV delta since version ``kv_since`` (None: a
        snapshot), cumulative counters, whether the instance is draining and, if its engine
        does not work, why."""
        tiers = [s.to_proto(name) for name, s in self.engine.tier_stats().items()]
        return instance_pb2.Heartbeat(instance_id=self.instance_id, seq=seq, load=self.load_report(),
                                      kv_events=self.kv_events(kv_since), counters=self.counters(),
                                      draining=self.draining, unhealthy_reason=self.health_problem(),
                                      kv_tiers=tiers)

    def health_problem(self) -> str:
        """Why the engine cannot serve ("" while it can; :meth:`StepWatchdog.problem
        <xllm.core.watchdog.StepWatchdog.problem>`): heartbeats come from the event loop, so they keep flowing
        while the engine thread is stuck."""
        return self.watchdog.problem()

    # ---- EngineService ------------------------------------------------------------------------
    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.draining:
            await _abort(context, DRAINING)
        rid = request.request_id
        REQUEST_ID.set(rid)  # this call's task: its log lines name the request
        decode = request.disagg_phase == engine_pb2.DISAGG_PHASE_DECODE
        reserved = self.handoff.expect_reservation(rid) if decode and self.handoff.enabled else None
        traced = self.tracer.begin(context.invocation_metadata(), request)
        try:  # (a constraint compiles off the loop)
            stream = await self.engine.submit_async(request, traced.record if traced is not None else None)
        except EngineError as exc:
            self.handoff.forget(rid)
            if traced is not None:
                traced.end(str(exc))
            await _abort(context, status_for(exc))
        await context.send_initial_metadata(((ACCEPTED_KEY, "1"),))
        call = _Call(rid, movable=request.movable, num_tokens=len(request.prompt_token_ids))
        self._calls[rid] = call
        failure: Status | None = None
        chunks = aiter(stream)
        pending = asyncio.ensure_future(anext(chunks))  # the stream's next chunk (never cancelled: that aborts)
        try:
            if reserved is not None:  # the reservation first: what the prefill instance needs
                await asyncio.wait({reserved, pending}, return_when=asyncio.FIRST_COMPLETED)
                if reserved.done():
                    yield engine_pb2.GenerateResponse(request_id=rid, kv_reservation=reserved.result())
            while True:
                try:
                    chunk = await asyncio.shield(pending)  # a broken call may leave the request detached
                    pending = None  # consumed
                except StopAsyncIteration:
                    break
                if call.handed_back and chunk.finish_reason == engine_pb2.FINISH_REASON_ABORT:
                    failure = HANDED_BACK
                    break
                stats = self.handoff.take_stats(rid)
                if stats is not None:
                    chunk.disagg_stats.CopyFrom(stats)
                if self.detached.enabled:
                    call.history.append(chunk)
                if traced is not None:
                    traced.observe(chunk)
                yield chunk
                if chunk.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                    break
                pending = asyncio.ensure_future(anext(chunks))
                offer = self._move_offer(call, request, chunk)
                if offer is not None:
                    yield offer
        except EngineError as exc:  # rejected on the engine thread (e.g. a duplicate id), or the engine died
            failure = status_for(exc)
        except (asyncio.CancelledError, GeneratorExit):  # the call broke: an Abort, or its caller is gone
            if (not call.aborted and not call.handed_back and not self.draining and reserved is None
                    and request.disagg_phase == engine_pb2.DISAGG_PHASE_NONE
                    and self.detached.detach(rid, call.history, pending or asyncio.ensure_future(anext(chunks)),
                                             chunks)):
                pending = None  # the request runs on, detached (xllm.engine.detached)
            raise
        except Exception:  # a bug met by this request: fail it alone (the gateway does not replay it)
            log.exception("engine %s: request %s failed", self.instance_id, rid)
            failure = status_for(RequestFailedError("internal error while serving the request"))
        finally:
            if pending is not None and not pending.done():
                pending.cancel()  # the call is gone: leaving the stream aborts the request
            if traced is not None:
                traced.end(failure.details if failure is not None else None if traced.finish else "the call broke")
            self.handoff.forget(rid)
            if self._calls.get(rid) is call:
                del self._calls[rid]
        if failure is not None:
            await _abort(context, failure)

    async def LoadLora(self, request: engine_pb2.LoadLoraRequest, context) -> engine_pb2.LoadLoraResponse:
        """Load (or, with an empty path, unload) a LoRA adapter between steps; a refusal is an answer, not a
        failed call (``error`` and the field at fault in ``param``)."""
        return await load_lora_answer(self.engine, request)

    async def Control(self, request: engine_pb2.ControlRequest, context) -> engine_pb2.ControlResponse:
        """Sleep, wake, update the weights in place (after draining) or report whether it sleeps; a refusal is
        an answer (``error``, ``param``)."""
        return await control_answer(self.engine, request)

    async def Embed(self, request: engine_pb2.EmbedRequest, context) -> engine_pb2.EmbedResponse:
        """A prompt's pooled hidden state, computed between steps; a refused one ends with its status."""
        try:
            return await embed_answer(self.engine, request)
        except EngineError as exc:
            await _abort(context, status_for(exc))

    async def Encode(self, request: engine_pb2.EncodeRequest, context) -> engine_pb2.EncodeResponse:
        """Images through the vision tower between steps (the E of EPD); a refused one ends with its status."""
        try:
            return await encode_answer(self.engine, request)
        except EngineError as exc:
            await _abort(context, status_for(exc))

    async def Abort(self, request: engine_pb2.AbortRequest, context) -> engine_pb2.AbortResponse:
        call = self._calls.get(request.request_id)
        if call is not None:
            call.aborted = True
        known = call is not None or self.detached.forget(request.request_id)
        self.engine.abort(request.request_id)
        return engine_pb2.AbortResponse(aborted=known)

    async def Health(self, request: engine_pb2.HealthRequest, context) -> engine_pb2.HealthResponse:
        problem = self.health_problem()
        if problem:
            return engine_pb2.HealthResponse(healthy=False, status=problem)
        if self.draining:
            return engine_pb2.HealthResponse(healthy=False, status="draining")
        return engine_pb2.HealthResponse(healthy=True, status="ok")

    async def Prove(self, request: engine_pb2.ProveRequest, context) -> engine_pb2.ProveResponse:
        """Prove this instance holds the cluster credential (:mod:`xllm.engine_api.credential`); the
        only call served without a proof from the caller. Without a credential there is nothing to prove."""
        keys = self.security.keys
        if keys is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no cluster credential to prove")
        if not 16 <= len(request.nonce) <= 64:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "nonce: 16 to 64 bytes")
        return engine_pb2.ProveResponse(instance_id=self.instance_id, address=self.address,
                                        mac=prove_mac(keys, request.nonce, self.instance_id, self.address))

    async def Reattach(self, request: engine_pb2.ReattachRequest, context: grpc.aio.ServicerContext):
        """Continue a detached request from output token ``from_token`` (:mod:`xllm.engine.detached`)."""
        try:
            entry, start = self.detached.attach(request.request_id, request.from_token)
        except ReattachRefused as exc:
            await _abort(context, exc.status)
        ended = False
        try:
            await context.send_initial_metadata(((ACCEPTED_KEY, "1"),))
            async for chunk in self.detached.stream(entry, start):
                yield chunk
            ended = True
        finally:
            self.detached.release(entry, ended)
        if entry.failure is not None:
            await _abort(context, entry.failure)

    async def GetLoad(self, request: engine_pb2.GetLoadRequest, context) -> instance_pb2.LoadReport:
        return self.load_report()

    async def TransferKV(self, request_iterator, context) -> engine_pb2.KVTransferAck:
        return await grpc_transport.receive(self.handoff, request_iterator, self.intake)

    async def Migrate(self, request: engine_pb2.MigrateRequest, context) -> engine_pb2.MigrateResponse:
        if request.request_id not in self._calls:
            return engine_pb2.MigrateResponse(accepted=False, error="the request is not running here")
        error = self.handoff.migrate(request.request_id, request.kv_target, request.num_tokens)
        return engine_pb2.MigrateResponse(accepted=not error, error=error)

    async def GetKVEvents(self, request: engine_pb2.GetKVEventsRequest, context) -> kv_events_pb2.KVCacheEvents:
        if request.snapshot or request.epoch == 0:
            return self.kv_events(None)
        return self.kv_events(request.since_version, request.epoch)


async def _abort(context: grpc.aio.ServicerContext, status: Status) -> None:
    await context.abort(status.code, status.details, status.trailing)
