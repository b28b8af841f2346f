"""Registering with a lease table in the same process (no RegistryService in between)."""

from __future__ import annotations

from xllm.engine_api.registration.embedded import DEFAULT_TTL, LeaseTable
from xllm.proto.registry.v1 import instance_pb2


class LocalPublisher:
    """An :class:`xllm.engine_api.registration.agent.Publisher` into a :class:`LeaseTable` of this
    process (an ``EmbeddedRegistry``): the agent's behaviour without the gRPC hop."""

    def __init__(self, leases: LeaseTable, ttl: float = DEFAULT_TTL) -> None:
        self.leases = leases
        self.ttl = ttl
        self.lease: int | None = None

    async def register(self, info: instance_pb2.InstanceInfo) -> None:
        self.lease, _ = self.leases.grant(info, self.ttl)

    async def heartbeat(self, hb: instance_pb2.Heartbeat) -> bool:
        if self.lease is None:
            return False
        ok = self.leases.keepalive(self.lease, hb)
        if not ok:
            self.lease = None
        return ok

    async def deregister(self) -> None:
        if self.lease is not None:
            lease, self.lease = self.lease, None
            self.leases.revoke(lease)

    async def close(self) -> None:
        pass

    def describe(self) -> str:
        return "in-process registry"
