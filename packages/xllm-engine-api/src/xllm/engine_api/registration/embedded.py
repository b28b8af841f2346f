"""The embedded registry's wire protocol, ``xllm.registry.v1.RegistryService``, both sides.

A gateway that starts engine processes itself (``xllm serve --instances N``) keeps the registry
in its own process and serves this service on a loopback port (:func:`serve_registry` over its
:class:`LeaseTable`); each engine process registers with :class:`GrpcRegistryPublisher`. The
lease semantics are etcd's: a lease per registration, renewed by every heartbeat, dropped when
it expires.

Hardening (the registry decides who receives traffic, so it trusts nothing it is told):

- the service requires the cluster token when there is one and binds loopback only without one
  (:mod:`xllm.engine_api.security`);
- with a cluster token, a registration's info must be signed with it, at most ``RECORD_MAX_AGE`` s
  ago (:func:`xllm.engine_api.credential.verify_record`; ``PERMISSION_DENIED`` otherwise):
  :class:`GrpcRegistryPublisher` signs it;
- a lease id is a random 63-bit number, the capability to heartbeat and deregister: only the
  process that registered knows it;
- the TTL a client asks for is clamped to ``[MIN_TTL, MAX_TTL]`` (the response says what was
  granted); a negative or non-finite one is ``INVALID_ARGUMENT``;
- an instance id held by a live lease cannot be taken over (``ALREADY_EXISTS``) unless the new
  registration names the same address — only one process can listen there, so that is the holder
  registering again (a restart on a fixed port, a lost ``Register`` answer). Any other claimant
  gets the id once the holder deregisters or its lease expires;
- a heartbeat counts only for the instance its lease holds; with a cluster token, only if signed for
  that lease with a seq above the last one applied (:func:`~xllm.engine_api.credential.verify_heartbeat`;
  a refused one renews nothing and answers ``ok=False``).
"""

from __future__ import annotations

import logging
from typing import Protocol

import grpc

from xllm.engine_api.credential import RecordRefusedError, sign_heartbeat, sign_record
from xllm.engine_api.security import NO_SECURITY, ClusterSecurity, bind, new_server, open_channel
from xllm.proto.registry.v1 import instance_pb2, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_TTL = 3.0
MIN_TTL = 1.0   # shorter leases would expire between heartbeats of a busy engine
MAX_TTL = 60.0  # longer ones would keep a dead instance routable for minutes


class LeaseConflictError(RuntimeError):
    """The instance id is held by another live lease (see the module docstring)."""


class RegistrationRefusedError(RuntimeError):
    """The registry refused this engine's registration (wrong cluster token, id taken, bad TTL)."""


class LeaseTable(Protocol):
    """The gateway's side: registrations under leases (``xllm.gateway.registry.EmbeddedRegistry``)."""

    def grant(self, info: instance_pb2.InstanceInfo, ttl: float) -> tuple[int, float]:
        """Register ``info`` under a new lease; returns ``(lease_id, ttl granted)``. Raises
        :class:`LeaseConflictError` if another live lease holds the id, ``ValueError`` for a
        negative or non-finite ``ttl``, :class:`~xllm.engine_api.credential.RecordRefusedError` for a
        record the table's credential does not verify."""
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
        try:
            lease_id, ttl = self.leases.grant(request.info, request.ttl_seconds or DEFAULT_TTL)
        except LeaseConflictError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except RecordRefusedError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return registry_pb2.RegisterResponse(lease_id=lease_id, ttl_seconds=ttl)

    async def Heartbeat(self, request: registry_pb2.HeartbeatRequest, context) -> registry_pb2.HeartbeatResponse:
        hb = request.heartbeat if request.HasField("heartbeat") else None
        return registry_pb2.HeartbeatResponse(ok=self.leases.keepalive(request.lease_id, hb))

    async def Deregister(self, request: registry_pb2.DeregisterRequest, context) -> registry_pb2.DeregisterResponse:
        self.leases.revoke(request.lease_id)
        return registry_pb2.DeregisterResponse()


async def serve_registry(leases: LeaseTable, host: str = "127.0.0.1", port: int = 0,
                         security: ClusterSecurity = NO_SECURITY) -> tuple[grpc.aio.Server, int]:
    """Serve ``RegistryService`` over ``leases`` on ``host:port`` (0: a free port), requiring the
    cluster token and serving TLS as ``security`` says."""
    server = new_server(security)
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(RegistryServicer(leases), server)
    bound = bind(server, host, port, security, "the embedded registry")
    await server.start()
    log.info("embedded registry serving RegistryService on %s:%d", host, bound)
    return server, bound


class GrpcRegistryPublisher:
    """An engine's side: registers with a gateway's embedded registry at ``address`` (``host:port``),
    presenting the cluster token (and verifying TLS) of ``security``."""

    def __init__(self, address: str, ttl: float = DEFAULT_TTL, rpc_timeout: float = 2.0,
                 security: ClusterSecurity = NO_SECURITY) -> None:
        self.address = address
        self.ttl = ttl
        self.rpc_timeout = rpc_timeout
        self.security = security
        self.lease: int | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: registry_pb2_grpc.RegistryServiceStub | None = None

    def _get_stub(self) -> registry_pb2_grpc.RegistryServiceStub:
        if self._stub is None:
            self._channel = open_channel(self.address, self.security, options=[
                ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)])
            self._stub = registry_pb2_grpc.RegistryServiceStub(self._channel)
        return self._stub

    async def register(self, info: instance_pb2.InstanceInfo) -> None:
        """Register ``info``; raises :class:`RegistrationRefusedError` when the registry says no (the
        agent retries: an id still held by a lease that is about to expire becomes free). With a
        cluster token the info is signed (now, no lease: the registry grants it afterwards)."""
        if self.security.keys is not None:
            info = sign_record(self.security.keys, info)
        try:
            resp = await self._get_stub().Register(registry_pb2.RegisterRequest(info=info, ttl_seconds=self.ttl),
                                                   timeout=self.rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.ALREADY_EXISTS,
                              grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED):
                raise RegistrationRefusedError(f"{self.describe()} refused {info.instance_id}: "
                                               f"{exc.code().name}: {exc.details()}") from None
            raise
        if abs(resp.ttl_seconds - self.ttl) > 1e-3:
            log.warning("%s granted a %.1f s lease instead of %.1f s", self.describe(), resp.ttl_seconds, self.ttl)
        self.lease = resp.lease_id

    async def heartbeat(self, hb: instance_pb2.Heartbeat) -> bool:
        if self.lease is None:
            return False
        if self.security.keys is not None:
            hb = sign_heartbeat(self.security.keys, hb, self.lease)
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
