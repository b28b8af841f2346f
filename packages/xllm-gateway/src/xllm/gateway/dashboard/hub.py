"""The live cluster page's data: the event hub (what happened) and the snapshot (what is).

:class:`EventHub` is the one object the gateway's parts publish to (the role controller's flips,
the mover's migrations and recomputes): each event gets a sequence number and a wall-clock time,
is kept in a bounded ring of recent events (a page that connects, or reconnects after ``after``,
is sent what it missed that the ring still holds) and is offered to every subscriber's bounded
queue. A subscriber that does not keep up loses its oldest queued events (counted in
:attr:`Subscription.dropped`, which the stream reports), so a slow browser never blocks the gateway,
nor grows its memory. The hub is not thread-safe: publish and subscribe on the gateway's event loop.

:func:`build_snapshot` reads the registry, role controller, router and mover into one JSON-ready
dict (:class:`ClusterSnapshot`): instances (role, flip under way and its reason, health, load, KV
usage per tier, prefix hit rate), pools per model, migrations in flight, TTFT/TPOT/E2E percentiles
and SLO attainment over the router's window (:class:`~xllm.gateway.router.RecentLatencies`), and
the recent requests' span timelines when tracing provides them (:class:`RequestTimelines`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from xllm.gateway.moves import Mover
    from xllm.gateway.registry.base import InstanceState, Registry
    from xllm.gateway.roles import RoleController
    from xllm.gateway.router import Router
    from xllm.proto.registry.v1 import instance_pb2

EVENT_KINDS = ("role_flip_started", "role_flip_finished", "move_started", "move_finished")
PERCENTILES = (50, 90, 99)
TRACING_OFF_HINT = ("Tracing is off: start the gateway with --otlp-traces-endpoint URL to see each request's "
                    "spans here.")


class RequestTimelines(Protocol):
    """The recent requests' spans (provided by the gateway's tracing; None: tracing is off)."""

    def recent(self, limit: int = 50) -> list[dict]:
        """Newest first: {"trace_id", "request_id", "name", "start_unix", "duration_s", "status",
        "spans": [{"name", "span_id", "parent_id", "start_unix", "end_unix", "attributes": {...}}]}"""


# ---- events ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DashboardEvent:
    """One published event: ``seq`` (1, 2, ... per hub), ``kind`` (:data:`EVENT_KINDS` or another
    name a part publishes), ``time`` (unix seconds when published), ``data`` (JSON-ready)."""

    seq: int
    kind: str
    time: float
    data: dict

    def to_dict(self) -> dict:
        return {"seq": self.seq, "kind": self.kind, "time": self.time, "data": self.data}

    def sse(self) -> bytes:
        """This event as one Server-Sent Events message (``id``, ``event``, one ``data`` line)."""
        return sse_message(self.kind, self.to_dict(), self.seq)


def sse_message(event: str, data: dict, event_id: int | None = None) -> bytes:
    """One SSE message: optional ``id:``, ``event:``, the data as one line of compact JSON (JSON escapes
    every newline, so a message never splits), ended by a blank line."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'), default=_jsonable)}\n\n".encode()


def _jsonable(value: object) -> object:
    return float(value) if isinstance(value, (int, float)) else str(value)


@dataclass(eq=False)
class Subscription:
    """One page's feed: its bounded queue and the events it lost for being slow (hashed by identity)."""

    queue: asyncio.Queue[DashboardEvent]
    dropped: int = 0


class EventHub:
    """Recent events in a ring of ``ring_size``, fanned out to subscribers' queues of ``queue_size``
    (see the module docstring)."""

    def __init__(self, ring_size: int = 500, queue_size: int = 256) -> None:
        self.ring: deque[DashboardEvent] = deque(maxlen=ring_size)
        self.queue_size = queue_size
        self.subscribers: set[Subscription] = set()
        self.seq = 0

    def publish(self, kind: str, data: dict) -> DashboardEvent:
        """Record ``kind`` with ``data`` now and offer it to every subscriber (never blocks)."""
        self.seq += 1
        event = DashboardEvent(self.seq, kind, time.time(), data)
        self.ring.append(event)
        for sub in self.subscribers:
            if sub.queue.full():  # the slow page loses its oldest event, never the gateway its time
                sub.queue.get_nowait()
                sub.dropped += 1
            sub.queue.put_nowait(event)
        return event

    def recent(self, after: int = 0) -> list[DashboardEvent]:
        """The ring's events with ``seq > after``, oldest first."""
        return [e for e in self.ring if e.seq > after]

    def subscribe(self) -> Subscription:
        sub = Subscription(asyncio.Queue(self.queue_size))
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self.subscribers.discard(sub)


# ---- the snapshot ----------------------------------------------------------------------------------------
@dataclass
class TierView:
    """A lower KV tier of an instance (host DRAM, disk, the cluster store), as its heartbeat reported it."""

    tier: str
    used_bytes: int
    capacity_bytes: int
    queries: int
    hits: int
    up: bool


@dataclass
class InstanceView:
    """One instance on the page. ``health``: ``healthy``, ``draining``, ``unhealthy``, ``breaker_open``;
    ``flip``: the role flip under way ({to, trigger, reason, seconds}) or None; ``prefix_hit_rate``:
    prompt tokens found in its prefix cache over those looked up since it started (None: not reported);
    ``counters``: its cumulative KV hand-off/migration counts (the page derives rates)."""

    id: str
    model: str
    role: str
    registered_role: str
    address: str
    health: str
    health_detail: str
    running: int
    waiting: int
    inflight: int
    kv_usage: float
    kv_free_tokens: int
    pending_prefill_tokens: int
    recent_ttft: float
    recent_tpot: float
    prefix_hit_rate: float | None
    heartbeat_age_s: float | None
    flip: dict | None = None
    tiers: list[TierView] = field(default_factory=list)
    counters: dict = field(default_factory=dict)


@dataclass
class LatencySummary:
    """Percentiles (seconds) of one latency over the window, ``n`` samples, and the share within
    ``slo`` (None: no objective set or no sample)."""

    n: int
    p50: float | None
    p90: float | None
    p99: float | None
    slo: float | None = None
    attainment: float | None = None


@dataclass
class ClusterSnapshot:
    """Everything the page draws once a second (times in unix seconds, latencies in seconds)."""

    time: float
    seq: int  # the hub's last event when the snapshot was taken
    uptime_s: float
    instances: list[InstanceView]
    pools: dict[str, dict[str, int]]  # model -> pool -> instances
    moves: list[dict]                 # in flight (MoveRecord dicts)
    kv_bytes_under_way: int
    kv_bandwidth_bytes_s: float
    latency: dict[str, LatencySummary]
    latency_series: list[dict]        # per bucket: {"t": seconds ago (bucket end), "ttft_p50", ...}
    window_s: float
    requests: list[dict] | None       # recent requests' span timelines (None: tracing off)
    tracing_hint: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation between order statistics (numpy's default);
    None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], slo: float | None = None) -> LatencySummary:
    """``values``' percentiles and, with ``slo``, the share of them at or under it."""
    p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
    attained = None
    if slo is not None and values:
        attained = sum(1 for v in values if v <= slo) / len(values)
    return LatencySummary(len(values), p50, p90, p99, slo, attained)


def latency_series(samples: dict[str, list[tuple[float, float]]], now: float, window_s: float,
                   bucket_s: float) -> list[dict]:
    """p50/p99 of each kind per ``bucket_s`` over the last ``window_s`` (``samples``: kind -> (monotonic
    time, seconds)); oldest bucket first, ``t`` its end in seconds before ``now`` (buckets without
    samples have None)."""
    n = max(int(window_s // bucket_s), 1)
    buckets: list[dict[str, list[float]]] = [{k: [] for k in samples} for _ in range(n)]
    for kind, pairs in samples.items():
        for t, v in pairs:
            age = now - t
            if 0 <= age < n * bucket_s:
                buckets[n - 1 - int(age // bucket_s)][kind].append(v)
    out = []
    for i, bucket in enumerate(buckets):
        row: dict = {"t": (n - 1 - i) * bucket_s}
        for kind, values in bucket.items():
            row[f"{kind}_p50"] = percentile(values, 50)
            row[f"{kind}_p99"] = percentile(values, 99)
            row[f"{kind}_n"] = len(values)
        out.append(row)
    return out


def health_of(st: InstanceState) -> tuple[str, str]:
    """(``healthy`` | ``draining`` | ``unhealthy`` | ``breaker_open``, a detail) from the registry's view
    (no call to the instance)."""
    if st.draining:
        return "draining", "shutting down: gets no new requests"
    if st.unhealthy:
        return "unhealthy", st.unhealthy
    if not st.breaker.closed:
        return "breaker_open", f"circuit breaker {st.breaker.state.value} after {st.breaker.failures} failure(s)"
    return "healthy", ""


COUNTER_FIELDS = ("kv_handoffs_sent", "kv_handoffs_installed", "kv_handoff_failures", "kv_transfer_bytes",
                  "kv_migrations_sent", "kv_migrations_installed", "kv_migration_failures", "prefix_cache_queries",
                  "prefix_cache_hits", "finished_requests", "generation_tokens", "prompt_tokens")


def instance_view(st: InstanceState, load: instance_pb2.LoadReport | None, roles: RoleController | None,
                  now_mono: float) -> InstanceView:
    """What the page shows of ``st`` with its last ``load`` report (None: unknown)."""
    health, detail = health_of(st)
    counters = {f: int(getattr(st.counters, f)) for f in COUNTER_FIELDS} if st.counters is not None else {}
    queries = counters.get("prefix_cache_queries", 0)
    hit_rate = counters["prefix_cache_hits"] / queries if queries else None
    flip = None
    if st.flip is not None:
        seconds = (roles.clock() if roles is not None else now_mono) - st.flip.started
        flip = {"from": st.flip.from_role, "to": st.flip.to_role, "trigger": st.flip.trigger,
                "reason": st.flip.reason, "seconds": round(max(seconds, 0.0), 3)}
    tiers = [TierView(t.tier, int(t.used_bytes), int(t.capacity_bytes), int(t.queries), int(t.hits), bool(t.up))
             for t in st.kv_tiers]
    return InstanceView(
        id=st.instance_id, model=st.model, role=st.role, registered_role=st.registered_role,
        address=st.info.address or "in-process", health=health, health_detail=detail,
        running=int(load.num_running) if load is not None else 0,
        waiting=int(load.num_waiting) if load is not None else 0, inflight=st.inflight,
        kv_usage=float(load.kv_usage) if load is not None else 0.0,
        kv_free_tokens=int(load.kv_free_tokens) if load is not None else 0,
        pending_prefill_tokens=int(load.pending_prefill_tokens) if load is not None else 0,
        recent_ttft=float(load.recent_ttft) if load is not None else 0.0,
        recent_tpot=float(load.recent_tpot) if load is not None else 0.0,
        prefix_hit_rate=hit_rate,
        heartbeat_age_s=None if st.local or not st.heartbeats else round(now_mono - st.last_heartbeat, 3),
        flip=flip, tiers=tiers, counters=counters)


@dataclass
class SnapshotSources:
    """What a snapshot reads: the registry (required) and, when the app has them, the role controller,
    router, mover, hub and request timelines; ``slo_ttft_s`` / ``slo_tpot_s`` the objectives attainment
    is measured against (None: none); ``started`` the gateway's start (unix seconds)."""

    registry: Registry
    roles: RoleController | None = None
    router: Router | None = None
    mover: Mover | None = None
    hub: EventHub | None = None
    timelines: RequestTimelines | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    started: float = field(default_factory=time.time)
    bucket_s: float = 10.0
    request_limit: int = 30
    reuse_s: float = 0.5  # a snapshot this recent is sent again rather than rebuilt (several pages open)
    _last: tuple[float, ClusterSnapshot] | None = field(default=None, repr=False)

    async def snapshot(self) -> ClusterSnapshot:
        """:func:`build_snapshot`, shared by the pages asking within ``reuse_s`` of each other."""
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.reuse_s:
            return self._last[1]
        snap = await build_snapshot(self)
        self._last = (time.monotonic(), snap)
        return snap


async def build_snapshot(src: SnapshotSources) -> ClusterSnapshot:
    """The cluster as it is now (see :class:`ClusterSnapshot`); an in-process instance without a heartbeat
    is asked for its load (one that fails shows as unknown load)."""
    states = src.registry.states()
    loads = await asyncio.gather(*(_load(s) for s in states))
    now_mono = src.registry.clock()
    views = [instance_view(s, load, src.roles, now_mono) for s, load in zip(states, loads)]
    views.sort(key=lambda v: (v.model, v.id))
    pools: dict[str, dict[str, int]] = {}
    for v in views:
        pool = v.role if v.flip is None else f"{v.flip['from']}_to_{v.flip['to']}"
        counts = pools.setdefault(v.model, {})
        counts[pool] = counts.get(pool, 0) + 1
    latency: dict[str, LatencySummary] = {}
    series: list[dict] = []
    window = 0.0
    if src.router is not None:
        recent = src.router.recent
        window = recent.horizon
        slos = {"ttft": src.slo_ttft_s, "tpot": src.slo_tpot_s, "e2e": None}
        samples = {kind: recent.samples(kind) for kind in recent.KINDS}
        latency = {kind: summarize([v for _, v in pairs], slos[kind]) for kind, pairs in samples.items()}
        series = latency_series(samples, recent.clock(), window, src.bucket_s)
    moves = [r.to_dict() for r in src.mover.in_flight.values()] if src.mover is not None else []
    requests = None
    if src.timelines is not None:
        try:
            requests = src.timelines.recent(src.request_limit)
        except Exception as exc:  # a tracing fault shows in the panel, never breaks the page
            requests = []
            hint = f"the request timelines failed: {type(exc).__name__}: {exc}"
        else:
            hint = ""
    else:
        hint = TRACING_OFF_HINT
    return ClusterSnapshot(
        time=time.time(), seq=src.hub.seq if src.hub is not None else 0, uptime_s=time.time() - src.started,
        instances=views, pools=pools, moves=moves,
        kv_bytes_under_way=src.mover.bytes_under_way if src.mover is not None else 0,
        kv_bandwidth_bytes_s=float(src.mover.bandwidth.rate) if src.mover is not None else 0.0,
        latency=latency, latency_series=series, window_s=window, requests=requests, tracing_hint=hint)


async def _load(st: InstanceState) -> instance_pb2.LoadReport | None:
    if st.load is not None:
        return st.load
    try:
        return await asyncio.wait_for(st.client.load(), 2.0)
    except Exception:  # unreachable: shown without load
        return None
