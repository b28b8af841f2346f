"""The instance side of the registry: register, heartbeat, deregister.

:class:`InstanceAgent` runs in an engine process next to its
:class:`~xllm.engine.server.EngineServer`. Every interval (0.5 s) it takes a ``Heartbeat`` from
the server — load, the KV cache delta since the last *acknowledged* version, counters — and
publishes it, which also renews the lease. A heartbeat whose publication fails is not
acknowledged, so the next delta covers its events too (deltas overlap safely: see
``xllm.kvstore.v1.KVCacheEvents``). When the registry answers that the lease is gone (expired
during a pause, or the registry restarted without its data), the agent registers again and sends
a snapshot of its cache. While the registry cannot be reached (down, frozen: the publisher's calls
time out) the engine keeps serving and the agent keeps trying every interval, logging the outage
once it starts and once it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

from xllm.proto.registry.v1 import instance_pb2

log = logging.getLogger(__name__)


class Publisher(Protocol):
    """One registry backend's instance side (embedded registry over gRPC, etcd)."""

    async def register(self, info: instance_pb2.InstanceInfo) -> None:
        """Register ``info`` under a new lease."""
        ...

    async def heartbeat(self, hb: instance_pb2.Heartbeat) -> bool:
        """Publish ``hb`` and renew the lease; False if the lease is gone (register again)."""
        ...

    async def deregister(self) -> None:
        """Revoke the lease: gateways stop routing here at once."""
        ...

    async def close(self) -> None: ...

    def describe(self) -> str:
        """Where this publisher registers, for logs."""
        ...


class HeartbeatSource(Protocol):
    """Builds the heartbeats (an :class:`~xllm.engine.server.EngineServer`)."""

    def heartbeat(self, kv_since: int | None, seq: int = 0) -> instance_pb2.Heartbeat: ...


class InstanceAgent:
    """Keeps one engine instance registered and heartbeating."""

    def __init__(self, source: HeartbeatSource, info: instance_pb2.InstanceInfo, publisher: Publisher,
                 interval: float = 0.5) -> None:
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be > 0, got {interval}")
        self.source = source
        self.info = info
        self.publisher = publisher
        self.interval = interval
        self.registered = False
        self._acked: int | None = None  # KV version the registry has; None: send a snapshot
        self._seq = 0
        self._failures = 0
        self._failing_since = 0.0  # monotonic time of the first failure of the current outage
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
        log.info("instance %s registered (%s)", self.info.instance_id, self.publisher.describe())
        await self.beat()

    async def beat(self) -> bool:
        """Publish one heartbeat now; False if the lease was lost."""
        self._seq += 1
        hb = self.source.heartbeat(self._acked, self._seq)
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
                if self._failures:
                    log.info("instance %s: registry reachable again after %d failed attempts (%.1f s)",
                             self.info.instance_id, self._failures, time.monotonic() - self._failing_since)
                self._failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._failures:
                    self._failing_since = time.monotonic()
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
