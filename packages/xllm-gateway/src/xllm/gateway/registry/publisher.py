"""The instance side of the registry: register, heartbeat, deregister.

:class:`InstanceAgent` runs in an engine process next to its
:class:`~xllm.core.grpc_server.EngineServer`. Every interval (0.5 s) it takes a
``Heartbeat`` from the server — load, the KV cache delta since the last *acknowledged*
version, counters — and publishes it, which also renews the lease. A heartbeat whose
publication fails is not acknowledged, so the next delta covers its events too (deltas
overlap safely: see ``xllm.kvstore.v1.KVCacheEvents``). When the registry answers that the
lease is gone (expired during a pause, or the registry restarted), the agent registers again
and sends a snapshot of its cache.

Publishers, one per backend, all with ``register(info)``, ``heartbeat(hb) -> bool``,
``deregister()``, ``close()``:

- :class:`GrpcRegistryPublisher`: the embedded registry of a gateway, over ``RegistryService``;
- :class:`~xllm.gateway.registry.etcd.EtcdPublisher`: etcd leases and keys;
- :class:`LocalPublisher`: an :class:`EmbeddedRegistry` in the same process (tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import grpc

from xllm.core.grpc_server import EngineServer
from xllm.gateway.registry.embedded import EmbeddedRegistry
from xllm.proto.registry.v1 import instance_pb2, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)


class Publisher(Protocol):
    async def register(self, info: instance_pb2.InstanceInfo) -> None: ...

    async def heartbeat(self, hb: instance_pb2.Heartbeat) -> bool: ...

    async def deregister(self) -> None: ...

    async def close(self) -> None: ...


class GrpcRegistryPublisher:
    """Registers with a gateway's embedded registry at ``address`` (``host:port``)."""

    def __init__(self, address: str, ttl: float = 3.0, rpc_timeout: float = 2.0) -> None:
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


class LocalPublisher:
    """Publishes into an :class:`EmbeddedRegistry` of this process."""

    def __init__(self, registry: EmbeddedRegistry, ttl: float = 3.0) -> None:
        self.registry = registry
        self.ttl = ttl
        self.lease: int | None = None

    async def register(self, info: instance_pb2.InstanceInfo) -> None:
        self.lease, _ = self.registry.grant(info, self.ttl)

    async def heartbeat(self, hb: instance_pb2.Heartbeat) -> bool:
        if self.lease is None:
            return False
        ok = self.registry.keepalive(self.lease, hb)
        if not ok:
            self.lease = None
        return ok

    async def deregister(self) -> None:
        if self.lease is not None:
            lease, self.lease = self.lease, None
            self.registry.revoke(lease)

    async def close(self) -> None:
        pass

    def describe(self) -> str:
        return "in-process registry"


class InstanceAgent:
    """Keeps one engine instance registered and heartbeating."""

    def __init__(self, server: EngineServer, info: instance_pb2.InstanceInfo, publisher: Publisher,
                 interval: float = 0.5) -> None:
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be > 0, got {interval}")
        self.server = server
        self.info = info
        self.publisher = publisher
        self.interval = interval
        self.registered = False
        self._acked: int | None = None  # KV version the registry has; None: send a snapshot
        self._seq = 0
        self._failures = 0
        self._task: asyncio.Task | None = None
        self.registrations = 0

    async def start(self) -> None:
        """Register (retrying in the background if the registry is not reachable yet) and heartbeat."""
        with contextlib.suppress(Exception):
            await self._register()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _register(self) -> None:
        await self.publisher.register(self.info)
        self.registered = True
        self.registrations += 1
        self._acked = None
        log.info("instance %s registered (%s)", self.info.instance_id, _describe(self.publisher))
        await self.beat()

    async def beat(self) -> bool:
        """Publish one heartbeat now; False if the lease was lost."""
        self._seq += 1
        hb = self.server.heartbeat(self._acked, self._seq)
        ok = await self.publisher.heartbeat(hb)
        if ok:
            self._acked = hb.kv_events.version
        return ok

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                if not self.registered:
                    await self._register()
                elif not await self.beat():
                    log.warning("instance %s lost its registration; registering again", self.info.instance_id)
                    self.registered = False
                    await self._register()
                self._failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failures += 1
                if self._failures in (1, 10) or self._failures % 100 == 0:
                    log.warning("instance %s: registry unreachable (%s: %s); retrying", self.info.instance_id,
                                type(exc).__name__, exc)

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if deregister and self.registered:
            try:
                await self.publisher.deregister()
                log.info("instance %s deregistered", self.info.instance_id)
            except Exception as exc:
                log.warning("instance %s: deregistration failed (%s); the lease will expire", self.info.instance_id,
                            exc)
        self.registered = False


def _describe(publisher) -> str:
    describe = getattr(publisher, "describe", None)
    return describe() if describe else type(publisher).__name__
