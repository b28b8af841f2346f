"""The gateway's live view of engine instances, shared by every registry backend.

A registry backend has two halves speaking the same ``xllm.registry.v1`` messages:

- the *publisher* side, used by an engine instance: register ``InstanceInfo`` under a lease,
  heartbeat (``Heartbeat``: load, KV cache events, counters) to keep the lease, deregister on
  shutdown (:mod:`xllm.engine_api.registration`);
- the *view* side, used by a gateway: :class:`Registry` below. It holds one
  :class:`InstanceState` per live instance (its info, an engine client, the last heartbeat)
  and feeds the instances' KV events into the :class:`~xllm.kvstore.GlobalKVIndex` that
  KV-aware routing matches prompts against.

Backends differ only in how registrations and heartbeats arrive: in-process calls and a gRPC
``RegistryService`` (:mod:`~xllm.gateway.registry.embedded`), or an etcd watch
(:mod:`~xllm.gateway.registry.etcd`). In-process engines (``xllm serve`` on one machine) are
added with :meth:`Registry.register` and need no lease.

Trust: a view given the cluster credential (``credential``: the keys derived from the cluster token)
accepts a remote instance's record only when its signature verifies
(:func:`xllm.engine_api.credential.verify_record`; each backend adds its freshness rule: the etcd
lease the record is bound to, the age of an embedded registration). Refused records are logged and
counted by reason (``refused_records``, ``xllm:registry_refused_records``); they never become
instances, so nothing is ever sent to them. In-process engines need no record. Such a view applies a
heartbeat (load, KV events, counters, draining) only when it is signed for the lease its instance holds
with a seq above the last one applied (:meth:`Registry.heartbeat_trusted`); the rest are counted under
the ``heartbeat_*`` reasons and change nothing.

Everything here runs on the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from xllm.engine_api.client import EngineClient, GrpcEngineClient
from xllm.engine_api.credential import ClusterKeys, RecordRefusedError, verify_heartbeat, verify_record
from xllm.engine_api.wire import InstanceUnavailableError
from xllm.gateway.breaker import CircuitBreaker
from xllm.gateway.metrics import RegistryMetrics
from xllm.kvstore import GAP, GlobalKVIndex
from xllm.proto.enums import role_name
from xllm.proto.kvstore.v1 import kv_events_pb2
from xllm.proto.registry.v1 import instance_pb2

log = logging.getLogger(__name__)


class NoInstanceError(LookupError):
    """No live instance serves the requested model."""


@dataclass(frozen=True)
class RoleTransition:
    """A role flip under way (dynamic PD, :mod:`xllm.gateway.roles`): the instance gets no new
    work of either role until it holds nothing of ``from_role`` any more."""

    from_role: str
    to_role: str
    reason: str
    trigger: str
    started: float  # monotonic time the flip was decided


@dataclass
class InstanceState:
    """One registered instance: what it published and what this gateway sent it."""

    info: instance_pb2.InstanceInfo
    client: EngineClient
    load: instance_pb2.LoadReport | None = None
    counters: instance_pb2.EngineCounters | None = None
    kv_tiers: list[instance_pb2.KVTierStats] = field(default_factory=list)  # its lower KV tiers' counts
    draining: bool = False
    last_heartbeat: float = 0.0       # monotonic time of the last heartbeat
    heartbeats: int = 0
    hb_lease: int = 0                 # with a credential: the lease and seq of the last heartbeat applied
    hb_seq: int = 0
    local: bool = False               # an in-process engine (no lease, no heartbeats)
    # kept by the router
    inflight: int = 0                 # requests dispatched here and not finished
    pending_prefill: int = 0          # their uncached prompt tokens, until each one's first token
    pending_prompt: int = 0           # their whole prompt tokens, until each one's first token
    # the offline (co-location) share of the three above: online requests are routed on online load
    off_inflight: int = 0
    off_pending_prefill: int = 0
    off_pending_prompt: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)  # failures: no requests until a probe passes
    unhealthy: str = ""               # why its last heartbeat said the engine cannot serve ("" = fine)
    removed: bool = False
    # kept by the role controller (dynamic PD): the role this gateway gives the instance ("": the
    # registered one) and the flip under way, if any
    assigned_role: str = ""
    flip: RoleTransition | None = None
    # LoRA adapters this gateway loaded onto it at run time (name → hash root; unloaded ones removed)
    runtime_adapters: dict[str, int] = field(default_factory=dict)
    unloaded_adapters: set[str] = field(default_factory=set)  # registered ones this gateway unloaded since

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def model(self) -> str:
        return self.info.model.served_name

    def adapters(self) -> dict[str, int]:
        """The LoRA adapters it serves (name → the root its KV block hashes chain from): those it registered
        with (``--lora-modules``), and those this gateway loaded since (``runtime_adapters``)."""
        registered = dict(zip(self.info.model.lora_names, self.info.model.lora_hash_roots, strict=False))
        out = {**registered, **self.runtime_adapters} if self.runtime_adapters else registered
        return {k: v for k, v in out.items() if k not in self.unloaded_adapters} if self.unloaded_adapters else out

    @property
    def block_size(self) -> int:
        return self.info.model.block_size

    @property
    def role(self) -> str:
        """``"mixed"``, ``"prefill"`` or ``"decode"``: the part of requests the gateway sends it (the
        registered role until this gateway flips it; during a flip, the role it flips from)."""
        return self.assigned_role or role_name(self.info.role)

    @property
    def registered_role(self) -> str:
        """The role the instance registered with (``--role``)."""
        return role_name(self.info.role)


class Registry:
    """Live instances by id, their load and KV contents (the view half of a backend)."""

    backend = "view"

    def __init__(self, client_factory: Callable[[instance_pb2.InstanceInfo], EngineClient] | None = None,
                 clock: Callable[[], float] = time.monotonic, credential: ClusterKeys | None = None,
                 metrics: RegistryMetrics | None = None) -> None:
        """``credential``: verify remote instances' records with these keys (``None``: accept them
        unsigned, a cluster without a token); ``metrics``: where refusals (and, for etcd, the watch)
        are counted."""
        self.credential = credential
        self.metrics = metrics
        self.refused_records: dict[str, int] = {}  # by reason (see RecordRefusedError)
        self._states: dict[str, InstanceState] = {}
        self.kv_index = GlobalKVIndex(clock=clock)
        self._client_factory = client_factory or GrpcEngineClient
        self.clock = clock
        self._listeners: list[Callable[[str, InstanceState], None]] = []
        self._tasks: set[asyncio.Task] = set()
        self._resyncing: set[str] = set()

    # ---- view ---------------------------------------------------------------------------------
    def states(self, model: str | None = None) -> list[InstanceState]:
        return [s for s in self._states.values() if model is None or s.model == model]

    def get(self, instance_id: str) -> InstanceState | None:
        return self._states.get(instance_id)

    def instances(self, model: str | None = None) -> list[EngineClient]:
        return [s.client for s in self.states(model)]

    def served_models(self) -> list[str]:
        return sorted({s.model for s in self._states.values()})

    def adapters(self) -> dict[str, str]:
        """Every LoRA adapter a live instance serves → its base model (an adapter's requests go to those)."""
        out: dict[str, str] = {}
        for s in self._states.values():
            for name in s.adapters():
                out.setdefault(name, s.model)
        return out

    def routable(self, model: str) -> list[InstanceState]:
        """Instances of ``model`` that may get new requests: not draining, not reported unhealthy,
        their circuit breaker closed. An open breaker whose backoff is over gets its half-open probe
        here, in the background."""
        now = self.clock()
        out = []
        for s in self.states(model):
            if s.draining or s.unhealthy:
                continue
            if s.breaker.closed:
                out.append(s)
            elif s.breaker.probe_due(now) and _loop_running():
                s.breaker.start_probe()
                self.spawn(self._probe(s))
        return out

    async def _probe(self, state: InstanceState) -> None:
        """The half-open probe of ``state``'s breaker: a ``Health`` call."""
        try:
            healthy = (await state.client.health()).healthy
        except Exception:
            healthy = False
        state.breaker.probe_result(healthy, self.clock())
        log.info("instance %s: probe %s; breaker %s", state.instance_id, "passed" if healthy else "failed",
                 state.breaker.state.value)

    def add_listener(self, fn: Callable[[str, InstanceState], None]) -> None:
        """``fn(event, state)`` on ``"added"`` and ``"removed"``."""
        self._listeners.append(fn)

    # ---- in-process instances (no lease) -------------------------------------------------------
    def register(self, client: EngineClient) -> None:
        """Add an instance reached through ``client`` (in-process engines, tests); it stays until
        :meth:`deregister`."""
        self._upsert(client.info, client, local=True)

    def deregister(self, instance_id: str) -> None:
        self._remove(instance_id)

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start background work (watches, lease expiry)."""

    async def settled(self) -> None:
        """Return once the background work started so far (KV resyncs, closing replaced clients)
        and any it started in turn has ended."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for state in list(self._states.values()):
            if not state.local:  # in-process engines belong to whoever added them
                self._remove(state.instance_id)
        await asyncio.sleep(0)
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    # ---- applying registrations and heartbeats (backends call these) ----------------------------
    def _upsert(self, info: instance_pb2.InstanceInfo, client: EngineClient | None = None,
                local: bool = False) -> InstanceState:
        old = self._states.get(info.instance_id)
        if old is not None and _same_record(old.info, info) and (client is None or client is old.client):
            old.info.signature.CopyFrom(info.signature)  # signed again (a new lease): the same instance
            return old
        if old is not None:  # re-registered (restart, new address): start over
            self._remove(info.instance_id)
        state = InstanceState(info=instance_pb2.InstanceInfo(), client=client or self._client_factory(info),
                              local=local)
        state.info.CopyFrom(info)
        self._states[info.instance_id] = state
        log.info("instance %s joined (%s, model %s, block size %d)", info.instance_id, info.address or "in-process",
                 info.model.served_name, info.model.block_size)
        self._notify("added", state)
        return state

    def _remove(self, instance_id: str) -> None:
        state = self._states.pop(instance_id, None)
        if state is None:
            return
        state.removed = True
        self.kv_index.remove_instance(instance_id)
        log.info("instance %s left", instance_id)
        self._notify("removed", state)
        if state.inflight == 0:
            self.close_client(state)

    def close_client(self, state: InstanceState) -> None:
        """Close a removed instance's client (once its in-flight requests are done)."""
        if state.local:
            return
        if _loop_running():  # without a loop the client never opened a channel
            self.spawn(state.client.close())

    def _heartbeat(self, hb: instance_pb2.Heartbeat) -> bool:
        """Apply a heartbeat; False if the instance is unknown."""
        state = self._states.get(hb.instance_id)
        if state is None:
            return False
        state.last_heartbeat = self.clock()
        state.heartbeats += 1
        state.draining = hb.draining
        if hb.unhealthy_reason != state.unhealthy:
            log.warning("instance %s: %s", state.instance_id, hb.unhealthy_reason or "healthy again")
        state.unhealthy = hb.unhealthy_reason
        if hb.HasField("load"):
            state.load = hb.load
        if hb.HasField("counters"):
            state.counters = hb.counters
        state.kv_tiers = list(hb.kv_tiers)
        if hb.HasField("kv_events") and hb.kv_events.epoch:
            self._apply_kv(state, hb.kv_events)
        return True

    def _apply_kv(self, state: InstanceState, ev: kv_events_pb2.KVCacheEvents) -> None:
        if (self.kv_index.apply(state.instance_id, ev) == GAP and state.instance_id not in self._resyncing
                and _loop_running()):
            self.spawn(self._resync(state))

    async def _resync(self, state: InstanceState) -> None:
        """Missed KV events: ask the instance for what changed since our version (or everything)."""
        self._resyncing.add(state.instance_id)
        try:
            for snapshot in (False, True):
                known = self.kv_index.version(state.instance_id) or (0, 0)
                ev = await state.client.kv_events(known[1], known[0], snapshot=snapshot)
                if state.removed:
                    return
                if self.kv_index.apply(state.instance_id, ev) != GAP:
                    return
        except InstanceUnavailableError as exc:
            log.warning("KV resync of %s failed: %s", state.instance_id, exc)
        finally:
            self._resyncing.discard(state.instance_id)

    def heartbeat_trusted(self, state: InstanceState, hb: instance_pb2.Heartbeat, lease: int) -> bool:
        """Whether ``hb``, found under registry ``lease`` (etcd's lease of the key; the embedded
        registry's lease id), may be applied to ``state``: always without a credential; with one, it
        must verify for that lease with a seq above the last one applied under it (a refusal is counted
        and logged like a record's). The very heartbeat applied last, seen again (a re-read of etcd), is
        skipped without a count."""
        if self.credential is None:
            return True
        after = state.hb_seq if state.hb_lease == lease else 0
        if state.hb_lease == lease and hb.seq == after and hb.HasField("signature"):
            return False  # the last one applied, read again (or a copy of it): nothing new
        try:
            verify_heartbeat(self.credential, hb, lease, after)
        except RecordRefusedError as exc:
            self._count_refusal(exc, f"heartbeat of instance {state.instance_id!r} not applied")
            return False
        state.hb_lease, state.hb_seq = lease, hb.seq
        return True

    def _count_refusal(self, exc: RecordRefusedError, what: str) -> None:
        n = self.refused_records[exc.reason] = self.refused_records.get(exc.reason, 0) + 1
        if self.metrics is not None:
            self.metrics.record_refused(exc.reason)
        if n % 100 == 1:
            log.warning("refused (%s, %d so far): %s; %s", exc.reason, n, exc, what)

    def _verified(self, info: instance_pb2.InstanceInfo, lease: int | None = None,
                  max_age: float | None = None) -> bool:
        """Whether ``info`` may become an instance (always without a credential); a refusal is counted
        and logged (the first of each reason, then every 100th)."""
        try:
            self.check_record(info, lease, max_age)
        except RecordRefusedError:
            return False
        return True

    def check_record(self, info: instance_pb2.InstanceInfo, lease: int | None = None,
                     max_age: float | None = None) -> None:
        """Raise :class:`RecordRefusedError` (counted and logged) unless ``info`` verifies under the
        view's credential (nothing to check without one)."""
        if self.credential is None:
            return
        try:
            verify_record(self.credential, info, lease, max_age)
        except RecordRefusedError as exc:
            self._count_refusal(exc, f"instance record refused; address {info.address!r} gets nothing")
            raise

    # ---- helpers --------------------------------------------------------------------------------
    def _notify(self, event: str, state: InstanceState) -> None:
        for fn in self._listeners:
            try:
                fn(event, state)
            except Exception:
                log.exception("registry listener failed")

    def spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` as the view's background work (on the running loop): :meth:`settled` waits for it,
        :meth:`close` cancels it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _same_record(a: instance_pb2.InstanceInfo, b: instance_pb2.InstanceInfo) -> bool:
    """Whether two records describe the same registration (their signatures aside)."""
    if a.signature == b.signature:
        return a == b
    a2, b2 = instance_pb2.InstanceInfo(), instance_pb2.InstanceInfo()
    a2.CopyFrom(a)
    b2.CopyFrom(b)
    a2.ClearField("signature")
    b2.ClearField("signature")
    return a2 == b2


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
