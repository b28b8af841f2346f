"""The embedded registry: the single-machine default, living inside the gateway process.

In-process engines are added directly (:meth:`Registry.register`). Engine processes started
next to the gateway (``xllm serve --instances N``) register over gRPC with the
``xllm.registry.v1.RegistryService`` the gateway serves on a loopback port over this registry's
lease table (:func:`xllm.engine_api.registration.embedded.serve_registry`, where the engines' side
lives too): a lease per registration, renewed by every heartbeat, swept when it expires (the
same semantics as the etcd backend's leases, without etcd). Lease ids are random, TTLs bounded,
and a live instance id cannot be taken over by another address (the rules are in
:mod:`xllm.engine_api.registration.embedded`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from xllm.engine_api.client import EngineClient
from xllm.engine_api.credential import RECORD_MAX_AGE, ClusterKeys
from xllm.engine_api.registration.embedded import MAX_TTL, MIN_TTL, LeaseConflictError
from xllm.gateway.metrics import RegistryMetrics
from xllm.gateway.registry.base import Registry
from xllm.proto.registry.v1 import instance_pb2

log = logging.getLogger(__name__)


@dataclass
class _Lease:
    instance_id: str
    address: str
    ttl: float
    deadline: float


class EmbeddedRegistry(Registry):
    """In-process registry; remote engines hold leases renewed by heartbeats
    (a :class:`xllm.engine_api.registration.embedded.LeaseTable`)."""

    backend = "embedded"

    def __init__(self, client_factory: Callable[[instance_pb2.InstanceInfo], EngineClient] | None = None,
                 clock: Callable[[], float] = time.monotonic, sweep_interval: float = 0.1,
                 credential: ClusterKeys | None = None, metrics: RegistryMetrics | None = None) -> None:
        super().__init__(client_factory, clock, credential, metrics)
        self._leases: dict[int, _Lease] = {}
        self._sweep_interval = sweep_interval
        self._sweeper: asyncio.Task | None = None

    # ---- leases (the publisher side, called in-process or by RegistryService) -----------------
    def grant(self, info: instance_pb2.InstanceInfo, ttl: float) -> tuple[int, float]:
        """Register ``info`` under a new lease of ``ttl`` seconds, clamped to ``[MIN_TTL, MAX_TTL]``;
        returns ``(lease_id, ttl granted)``. The lease id is random (63 bits): it is what lets its
        holder heartbeat and deregister.

        An expired lease of the same instance id, or a live one registered with the same address
        (its holder registering again), is replaced; a live one of another address raises
        :class:`LeaseConflictError`. A negative or non-finite ``ttl`` raises ``ValueError``. With a
        credential, ``info`` must be signed with it at most ``RECORD_MAX_AGE`` s ago (else
        :class:`~xllm.engine_api.credential.RecordRefusedError`, counted)."""
        self.check_record(info, max_age=RECORD_MAX_AGE)
        ttl = float(ttl)
        if not math.isfinite(ttl) or ttl < 0:
            raise ValueError(f"ttl_seconds must be a finite number of seconds, got {ttl}")
        ttl = min(max(ttl, MIN_TTL), MAX_TTL)
        now = self.clock()
        for lease_id, lease in list(self._leases.items()):
            if lease.instance_id != info.instance_id:
                continue
            if lease.deadline >= now and lease.address != info.address:
                raise LeaseConflictError(
                    f"instance id {info.instance_id} is registered by {lease.address} under a live lease; "
                    f"it is free again once that instance deregisters or misses its heartbeats for {lease.ttl:.0f} s")
            del self._leases[lease_id]
        lease_id = 0
        while lease_id == 0 or lease_id in self._leases:
            lease_id = secrets.randbits(63)
        self._leases[lease_id] = _Lease(info.instance_id, info.address, ttl, now + ttl)
        self._upsert(info)
        return lease_id, ttl

    def keepalive(self, lease_id: int, heartbeat: instance_pb2.Heartbeat | None = None) -> bool:
        """Renew a lease and apply its heartbeat; False if the lease is unknown or expired, the
        heartbeat names another instance than the lease holds, or (with a credential) it is not signed
        for this lease or replays an old seq (then nothing is renewed nor applied)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.deadline < self.clock():
            return False
        if heartbeat is not None and heartbeat.instance_id and heartbeat.instance_id != lease.instance_id:
            return False
        state = self.get(lease.instance_id)
        if heartbeat is not None and state is not None and not self.heartbeat_trusted(state, heartbeat, lease_id):
            return False
        lease.deadline = self.clock() + lease.ttl
        if heartbeat is not None:
            heartbeat.instance_id = lease.instance_id
            self._heartbeat(heartbeat)
        return True

    def revoke(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._remove(lease.instance_id)

    def expire(self) -> list[str]:
        """Drop instances whose lease ran out; returns their ids."""
        now = self.clock()
        gone = [(lid, lease) for lid, lease in self._leases.items() if lease.deadline < now]
        for lease_id, lease in gone:
            del self._leases[lease_id]
            log.warning("instance %s missed its heartbeats for %.1f s: removed", lease.instance_id, lease.ttl)
            self._remove(lease.instance_id)
        return [lease.instance_id for _, lease in gone]

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_interval)
            self.expire()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._leases.clear()
        await super().close()
