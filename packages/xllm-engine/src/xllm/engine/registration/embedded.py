"""The embedded registry's wire protocol, ``xllm.registry.v1.RegistryService``, both sides.

A gateway that starts engine processes itself (``xllm serve --instances N``) keeps the registry
in its own process and serves this service on a loopback port (:func:`serve_registry` over its
:class:`LeaseTable`); each engine process registers with :class:`GrpcRegistryPublisher`. The
lease semantics are etcd's: a lease per registration, renewed by every heartbeat, dropped when
it expires.
"""

from __future__ import annotations

import logging
from typing import Protocol

import grpc

from xllm.proto.registry.v1 import instance_pb2, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_TTL = 3.0


class LeaseTable(Protocol):
    """The gateway's side: registrations under leases (``xllm.gateway.registry.EmbeddedRegistry``)."""

    def grant(self, info: instance_pb2.InstanceInfo, ttl: float) -> tuple[int, float]:
        """Register ``info`` under a new lease; returns ``(lease_id, ttl granted)``."""
        ...

    def keepalive(self, lease_id: int, heartbeat: instance_pb2.Heartbeat | None = None) -> bool:
        """Renew a lease and apply its heartbeat; False if the lease is unknown or expired."""
        ...

    def revoke(self, lease_id: int) -> None: ...


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    """``RegistryService`` over a :class:`LeaseTable`."""

    def __init__(self, leases: LeaseTable) -> None:
        self.leases = leases

    async def Register(self, request: registry_pb2.RegisterRequest, context) -> registry_pb2.RegisterResponse:
        if not request.info.instance_id or not request.info.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "info.instance_id and info.address are required")
        lease_id, ttl = self.leases.grant(request.info, request.ttl_seconds or DEFAULT_TTL)
        return registry_pb2.RegisterResponse(lease_id=lease_id, ttl_seconds=ttl)

    async def Heartbeat(self, request: registry_pb2.HeartbeatRequest, context) -> registry_pb2.HeartbeatResponse:
        hb = request.heartbeat if request.HasField("heartbeat") else None
        return registry_pb2.HeartbeatResponse(ok=self.leases.keepalive(request.lease_id, hb))

    async def Deregister(self, request: registry_pb2.DeregisterRequest, context) -> registry_pb2.DeregisterResponse:
        self.leases.revoke(request.lease_id)
        return registry_pb2.DeregisterResponse()


async def serve_registry(leases: LeaseTable, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.aio.Server, int]:
    """Serve ``RegistryService`` over ``leases`` on ``host:port`` (0: a free port)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(RegistryServicer(leases), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot bind the registry service to {host}:{port}")
    await server.start()
    log.info("embedded registry serving RegistryService on %s:%d", host, bound)
    return server, bound


class GrpcRegistryPublisher:
    """An engine's side: registers with a gateway's embedded registry at ``address`` (``host:port``)."""

    def __init__(self, address: str, ttl: float = DEFAULT_TTL, rpc_timeout: float = 2.0) -> None:
        self.address = address
        self.ttl = ttl
        self.rpc_timeout = rpc_timeout
        self.lease: int | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: registry_pb2_grpc.RegistryServiceStub | None = None

    def _get_stub(self) -> registry_pb2_grpc.RegistryServiceStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=[
                ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)])
            self._stub = registry_pb2_grpc.RegistryServiceStub(self._channel)
        return self._stub

    async def register(self, info: instance_pb2.InstanceInfo) -> None:
        resp = await self._get_stub().Register(registry_pb2.RegisterRequest(info=info, ttl_seconds=self.ttl),
                                               timeout=self.rpc_timeout)
        self.lease = resp.lease_id

    async def heartbeat(self, hb: instance_pb2.Heartbeat) -> bool:
        if self.lease is None:
            return False
        resp = await self._get_stub().Heartbeat(registry_pb2.HeartbeatRequest(lease_id=self.lease, heartbeat=hb),
                                                timeout=self.rpc_timeout)
        if not resp.ok:
            self.lease = None
        return resp.ok

    async def deregister(self) -> None:
        if self.lease is not None:
            lease, self.lease = self.lease, None
            await self._get_stub().Deregister(registry_pb2.DeregisterRequest(lease_id=lease),
                                              timeout=self.rpc_timeout)

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()

    def describe(self) -> str:
        return f"embedded registry at {self.address}"
