"""The embedded registry: the single-machine default, living inside the gateway process.

In-process engines are added directly (:meth:`Registry.register`). Engine processes started
next to the gateway (``xllm serve --instances N``) register over gRPC with the
``xllm.registry.v1.RegistryService`` this module serves on a loopback port: a lease per
registration, renewed by every heartbeat, swept when it expires (the same semantics as the
etcd backend's leases, without etcd).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from xllm.gateway.engine_client import EngineClient
from xllm.gateway.registry.base import Registry
from xllm.proto.registry.v1 import instance_pb2, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

MIN_TTL = 0.2


@dataclass
class _Lease:
    instance_id: str
    ttl: float
    deadline: float


class EmbeddedRegistry(Registry):
    """In-process registry; remote engines hold leases renewed by heartbeats."""

    backend = "embedded"

    def __init__(self, client_factory: Callable[[instance_pb2.InstanceInfo], EngineClient] | None = None,
                 clock: Callable[[], float] = time.monotonic, sweep_interval: float = 0.1) -> None:
        super().__init__(client_factory, clock)
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        self._sweep_interval = sweep_interval
        self._sweeper: asyncio.Task | None = None

    # ---- leases (the publisher side, called in-process or by RegistryService) -----------------
    def grant(self, info: instance_pb2.InstanceInfo, ttl: float) -> tuple[int, float]:
        """Register ``info`` under a new lease of ``ttl`` seconds; returns ``(lease_id, ttl)``.

        An earlier lease of the same instance id is revoked (the instance restarted)."""
        ttl = max(float(ttl), MIN_TTL)
        for lease_id, lease in list(self._leases.items()):
            if lease.instance_id == info.instance_id:
                del self._leases[lease_id]
        lease_id = next(self._lease_ids)
        self._leases[lease_id] = _Lease(info.instance_id, ttl, self.clock() + ttl)
        self._upsert(info)
        return lease_id, ttl

    def keepalive(self, lease_id: int, heartbeat: instance_pb2.Heartbeat | None = None) -> bool:
        """Renew a lease and apply its heartbeat; False if the lease is unknown or expired."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.deadline < self.clock():
            return False
        lease.deadline = self.clock() + lease.ttl
        if heartbeat is not None:
            if heartbeat.instance_id and heartbeat.instance_id != lease.instance_id:
                return False
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


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    """``xllm.registry.v1.RegistryService`` over an :class:`EmbeddedRegistry`."""

    def __init__(self, registry: EmbeddedRegistry) -> None:
        self.registry = registry

    async def Register(self, request: registry_pb2.RegisterRequest, context) -> registry_pb2.RegisterResponse:
        if not request.info.instance_id or not request.info.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "info.instance_id and info.address are required")
        lease_id, ttl = self.registry.grant(request.info, request.ttl_seconds or 3.0)
        return registry_pb2.RegisterResponse(lease_id=lease_id, ttl_seconds=ttl)

    async def Heartbeat(self, request: registry_pb2.HeartbeatRequest, context) -> registry_pb2.HeartbeatResponse:
        hb = request.heartbeat if request.HasField("heartbeat") else None
        return registry_pb2.HeartbeatResponse(ok=self.registry.keepalive(request.lease_id, hb))

    async def Deregister(self, request: registry_pb2.DeregisterRequest, context) -> registry_pb2.DeregisterResponse:
        self.registry.revoke(request.lease_id)
        return registry_pb2.DeregisterResponse()


async def serve_registry(registry: EmbeddedRegistry, host: str = "127.0.0.1", port: int = 0
                         ) -> tuple[grpc.aio.Server, int]:
    """Serve ``registry``'s RegistryService on ``host:port`` (0: a free port)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(RegistryServicer(registry), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot bind the registry service to {host}:{port}")
    await server.start()
    log.info("embedded registry serving RegistryService on %s:%d", host, bound)
    return server, bound
