"""Moving running requests off a draining instance: the gateway's answer to move offers (xLLM §3.5).

A draining engine offers each request of a ``movable`` call once it decodes (``MoveOffer``: its
tokens and KV bytes). :meth:`Mover.offer` picks a destination (a decoding instance other than the
source, by the router), predicts both ways to move (:func:`xllm.sched.move_cost`: the KV the
destination lacks over the measured hand-off bandwidth, against its tokens and the destination's
queued prefill over the destination's measured prefill speed) and either

- **migrates**: a :class:`Migration` reserves KV on the destination with a decode-phase
  continuation of the request (its tokens so far as earlier output, under the id ``<id>#<n>``) and
  asks the source to ``Migrate`` there. The source keeps streaming while its KV is copied and ends
  with ``FINISH_REASON_HANDED_OFF``; the destination's stream continues the request;
- or **recomputes**: the caller resumes the request elsewhere as after a failure (without counting
  one against the instance).

A migration that cannot start (no reservation, ``Migrate`` refused) or that the source gives up
(its stream is handed back) falls back to recompute. ``--drain-moves`` forces either way, or turns
moves off (requests then finish on the draining instance or are handed back at the drain timeout).

The same path hands over the requests of a decode instance flipping to prefill (dynamic PD,
:mod:`xllm.gateway.roles`): the instance is not draining, so the gateway makes the offer itself
(:meth:`Mover.handover`), its KV bytes estimated from the bytes per token the hand-offs
measured.

The mover owns the metrics of what it decides: ``xllm:request_moves_total{how}`` (``migrated``,
``recomputed``, ``migration_failed``, ``stayed``) and the client-visible pause when a request
leaves an instance, ``xllm:request_move_pause_seconds{how}`` (also ``resumed`` after a failure:
:class:`~xllm.gateway.failover.Failover`). The request's stream
(:class:`~xllm.gateway.dispatch.RoutedStream`) reports to it through :meth:`Mover.moved`,
:meth:`Mover.paused` and :meth:`Mover.migration_failed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from xllm.engine_api.wire import InstanceUnavailableError
from xllm.gateway.disagg import phase_request
from xllm.gateway.events import EventSink, publish_safely
from xllm.gateway.metrics import MoveMetrics
from xllm.gateway.registry import NoInstanceError
from xllm.gateway.tracing import NO_SPANS, RequestSpans
from xllm.proto.engine.v1 import engine_pb2
from xllm.sched import MOVE_MODES, MoveCost, RateEstimate, move_cost

if TYPE_CHECKING:
    from xllm.gateway.registry import InstanceState
    from xllm.gateway.router import Router, Ticket

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoveOptions:
    """``mode``: ``auto`` (by predicted cost), ``migrate``, ``recompute`` or ``off`` (no moves);
    ``bandwidth_prior``: bytes/s assumed for KV transfers until one was measured."""

    mode: str = "auto"
    bandwidth_prior: float = 200e6

    def __post_init__(self) -> None:
        if self.mode not in MOVE_MODES:
            raise ValueError(f"drain moves must be one of {', '.join(MOVE_MODES)}, not {self.mode!r}")
        if self.bandwidth_prior <= 0:
            raise ValueError("the KV bandwidth prior must be positive")


@dataclass
class MoveRecord:
    """One move as the live cluster page shows it (:attr:`Mover.in_flight`, :attr:`Mover.history`):
    ``how`` ``migrate`` or ``recompute``; wall-clock ``started`` / ``ended`` (unix seconds); ``outcome``
    ``""`` while under way, then ``done`` (the destination took it over), ``failed`` (a migration that
    could not start or was given up: recomputed instead) or ``cancelled`` (the request ended first)."""

    request_id: str
    model: str
    source: str
    destination: str
    how: str
    tokens: int
    kv_bytes: int
    started: float = field(default_factory=time.time)
    ended: float | None = None
    outcome: str = ""
    error: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


MOVE_HISTORY = 200  # finished moves Mover.history keeps (the newest)


@dataclass
class Recompute:
    """A request moved by recompute: until its continuation is placed, its prefill counts as
    queued on the destination it was priced for (``Router.hold_prefill``: the moves decided next
    see it)."""

    router: Router
    ticket: Ticket
    cost: MoveCost
    on_release: Callable[[], None] | None = None  # the mover's record of it (called once)

    def __post_init__(self) -> None:
        self.router.hold_prefill(self.ticket.state, self.cost.tokens_to_compute)

    def release(self) -> None:
        """The continuation is placed (its own accounting took over) or given up (once)."""
        self.router.hold_prefill(self.ticket.state, -self.cost.tokens_to_compute)
        self.cost = replace(self.cost, tokens_to_compute=0)
        if self.on_release is not None:
            self.on_release, on_release = None, self.on_release
            on_release()


class Migration:
    """One request moving with its KV: the reservation on the destination and the source's
    ``Migrate``, in the background while the source's stream goes on. Its bytes count as under
    way (``on_done`` when the copy is over or given up)."""

    def __init__(self, router: Router, source: Ticket, source_request_id: str, ticket: Ticket,
                 cont: engine_pb2.GenerateRequest, cost: MoveCost, on_done=None,
                 spans: RequestSpans = NO_SPANS) -> None:
        """``spans``: the request's trace (the call to the destination is a span of it)."""
        self.router = router
        self.spans = spans
        self._on_done = on_done
        self.source = source
        self.source_request_id = source_request_id
        self.ticket = ticket
        self.cont = cont
        self.cost = cost
        self._stream: AsyncIterator[engine_pb2.GenerateResponse] | None = None
        self._dispatched = False
        self.outcome = ""  # "handed_off" once the destination's stream was taken, "cancelled" when given up
        self.task = asyncio.ensure_future(self._run())

    @property
    def failure(self) -> str:
        """Why the move could not start ("" while it may): the request then stays with the source."""
        t = self.task
        if not t.done():
            return ""
        if t.cancelled():
            return "cancelled"
        exc = t.exception()
        return "" if exc is None else str(exc) or type(exc).__name__

    async def _run(self) -> None:
        rid, dest = self.cont.request_id, self.ticket.state
        trace = self.spans.engine_call(self.ticket, "decode", rid)
        try:
            stream = aiter(await dest.client.submit(phase_request(self.cont, engine_pb2.DISAGG_PHASE_DECODE), trace))
        except BaseException as exc:
            self.spans.left(self.ticket, f"{type(exc).__name__}: {exc}")
            raise
        try:
            first = await anext(stream)
            if not first.HasField("kv_reservation"):
                raise InstanceUnavailableError(f"{dest.instance_id} reserved no KV for {rid} "
                                               f"({first.error or 'no reservation'})", dest.instance_id)
            self.router.dispatched(self.ticket, 1)
            self.router.first_token(self.ticket, observe=False)  # nothing to prefill there but a few tokens
            self._dispatched = True
            answer = await self.source.state.client.migrate(self.source_request_id, first.kv_reservation,
                                                            len(self.cont.prompt_token_ids))
            if not answer.accepted:
                raise InstanceUnavailableError(f"{self.source.state.instance_id} would not migrate "
                                               f"{self.source_request_id}: {answer.error}")
        except BaseException as exc:
            await self._close(stream, f"{type(exc).__name__}: {exc}")
            raise
        self._stream = stream

    async def destination(self) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """The destination's stream, once the source handed the request off."""
        self.outcome = self.outcome or "handed_off"
        self._done()
        await self.task
        return self._stream

    async def cancel(self) -> None:
        """Give the move up (the source's stream ended another way): the reservation is dropped."""
        self.outcome = self.outcome or "cancelled"
        self._done()
        self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task
        if self._stream is not None:
            await self._close(self._stream, "the move was given up")

    def _done(self) -> None:
        if self._on_done is not None:
            self._on_done, on_done = None, self._on_done
            on_done()

    async def _close(self, stream, why: str) -> None:
        with contextlib.suppress(Exception):
            await stream.aclose()  # closing an open call aborts its request (and its reservation)
        self.spans.left(self.ticket, why)
        if self._dispatched:
            self._dispatched = False
            self.router.finished(self.ticket, True)


class Mover:
    """Answers move offers (see the module docstring); one per gateway."""

    def __init__(self, router: Router, options: MoveOptions | None = None, metrics: MoveMetrics | None = None,
                 events: EventSink | None = None) -> None:
        self.router = router
        self.options = options or MoveOptions()
        self.metrics = metrics or MoveMetrics()
        self.bandwidth = RateEstimate(self.options.bandwidth_prior)
        self.bytes_under_way = 0  # KV of the migrations being copied (they share the bandwidth)
        self.kv_bytes_per_token = 0.0  # as the last measured transfer moved them (0: none measured yet)
        # the live cluster page (xllm.gateway.dashboard): moves under way by request id, the last finished
        # ones; move_started / move_finished go to ``events``
        self.in_flight: dict[str, MoveRecord] = {}
        self.history: deque[MoveRecord] = deque(maxlen=MOVE_HISTORY)
        self.events = events
        self._failed: set[str] = set()  # request ids whose migration failed (told before it is given up)

    @property
    def enabled(self) -> bool:
        """Whether requests are sent ``movable`` (a draining instance offers to move them)."""
        return self.options.mode != "off"

    def moved(self, model: str, how: str) -> None:
        """A request landed on its destination: ``migrated`` or ``recomputed`` (counted)."""
        self.metrics.moved(model, how)

    def paused(self, model: str, how: str, seconds: float) -> None:
        """The gap a request's client saw when it left an instance (``resumed`` after a failure,
        ``migrated``, ``recomputed``): its last chunk there to its first from the next."""
        self.metrics.paused(model, how, seconds)

    def migration_failed(self, model: str, request_id: str, migration: Migration) -> None:
        """``migration`` could not start or was given up (:attr:`Migration.failure`): the request is
        recomputed elsewhere instead (logged, counted as ``migration_failed``)."""
        log.warning("request %s: migrating off %s failed (%s); recomputing elsewhere",
                    request_id, migration.source.state.instance_id, migration.failure)
        self.metrics.moved(model, "migration_failed")
        record = self.in_flight.get(migration.cont.request_id)
        if record is not None:
            record.error = migration.failure
            self._failed.add(migration.cont.request_id)

    def observe_transfer(self, stats: engine_pb2.DisaggStats) -> None:
        """A KV transfer the destination measured (PD hand-off or migration)."""
        if not stats.recomputed:
            self.bandwidth.observe(stats.transfer_bytes, stats.transfer_seconds)
            if stats.transferred_tokens:
                self.kv_bytes_per_token = stats.transfer_bytes / stats.transferred_tokens

    def handover_offer(self, num_tokens: int, source: InstanceState) -> engine_pb2.MoveOffer:
        """The offer a draining instance would make for a request of ``num_tokens`` tokens, made by
        the gateway for a role flip: KV bytes from the measured bytes per token (0 while nothing was
        measured: the move is then predicted as a free copy, i.e. migrated, which is what it costs
        next to a recompute in practice), the source's measured prefill speed."""
        speed = source.load.prefill_tokens_per_s if source.load is not None else 0.0
        return engine_pb2.MoveOffer(num_tokens=num_tokens, kv_bytes=int(self.kv_bytes_per_token * num_tokens),
                                    prefill_tokens_per_s=speed)

    def handover(self, model: str, source: Ticket, source_request_id: str, cont: engine_pb2.GenerateRequest,
                 spans: RequestSpans = NO_SPANS) -> Migration | Recompute | None:
        """Move a request off ``source`` for a role flip (decode to prefill): the offer a draining
        instance would make (:meth:`handover_offer`, the tokens of ``cont``), answered as
        :meth:`offer` answers one."""
        return self.offer(model, source, source_request_id, cont,
                          self.handover_offer(len(cont.prompt_token_ids), source.state), spans)

    def offer(self, model: str, source: Ticket, source_request_id: str, cont: engine_pb2.GenerateRequest,
              offer: engine_pb2.MoveOffer, spans: RequestSpans = NO_SPANS) -> Migration | Recompute | None:
        """Decide how to move the request ``source`` offers: a started :class:`Migration` (its call to the
        destination a span of ``spans``), a :class:`Recompute` (the caller resumes it and then releases it) or
        None (no other instance decodes the model: it stays)."""
        tokens = list(cont.prompt_token_ids)
        try:
            ticket = self.router.route_move(model, tokens, exclude={source.state.instance_id}, lora=cont.lora_name)
        except NoInstanceError:
            self.metrics.moved(model, "stayed")
            return None
        snap = self.router.snapshot(ticket.state, ticket.matched_tokens)
        # the destination's prefill speed; one that never prefilled (a PD decode instance) is
        # estimated by the source's or, failing that, the fastest instance of the model's
        speed = snap.prefill_tokens_per_s or offer.prefill_tokens_per_s or self.router.fastest_prefill(model)
        cost = move_cost(offer.kv_bytes, len(tokens), ticket.matched_tokens, self.bandwidth.rate,
                         snap.pending_prefill_tokens, speed, self.bytes_under_way)
        migrate = {"migrate": True, "recompute": False}.get(self.options.mode, cost.migrate)
        log.info("moving %s off %s: %d tokens, %d KV bytes; %s: %s", cont.request_id.rsplit("#", 1)[0],
                 source.state.instance_id, len(tokens), offer.kv_bytes, cost.describe(),
                 f"migrating to {ticket.state.instance_id}" if migrate else "recomputing elsewhere")
        record = MoveRecord(cont.request_id, model, source.state.instance_id, ticket.state.instance_id,
                            "migrate" if migrate else "recompute", len(tokens), offer.kv_bytes)
        self._started(record)
        if not migrate:
            return Recompute(self.router, ticket, cost, on_release=lambda: self._ended(record, "done"))
        self.bytes_under_way += cost.bytes_to_send
        migration = Migration(self.router, source, source_request_id, ticket, cont, cost,
                              on_done=lambda: self._copied(cost.bytes_to_send, record, migration), spans=spans)
        return migration

    def _copied(self, sent: int, record: MoveRecord | None = None, migration: Migration | None = None) -> None:
        self.bytes_under_way = max(self.bytes_under_way - sent, 0)
        if record is not None and migration is not None:
            failed = record.request_id in self._failed or bool(migration.failure)
            self._failed.discard(record.request_id)
            self._ended(record, "failed" if failed else "done" if migration.outcome == "handed_off" else "cancelled")

    # ---- the moves' record (the live cluster page) ------------------------------------------------------
    def _started(self, record: MoveRecord) -> None:
        self.in_flight[record.request_id] = record
        self._publish("move_started", record)

    def _ended(self, record: MoveRecord, outcome: str) -> None:
        if self.in_flight.pop(record.request_id, None) is None:
            return
        record.ended, record.outcome = time.time(), outcome
        self.history.append(record)
        self._publish("move_finished", record)

    def _publish(self, kind: str, record: MoveRecord) -> None:
        publish_safely(self.events, kind, record.to_dict())
