"""The etcd registry backend: instances and heartbeats as leased keys under a namespace prefix.

Layout under ``PREFIX`` (default ``/xllm``), values are serialized protobuf messages:

- ``PREFIX/instances/ID``  -> ``xllm.registry.v1.InstanceInfo``, written once per registration
- ``PREFIX/heartbeats/ID`` -> ``xllm.registry.v1.Heartbeat``, rewritten every heartbeat

Both keys hang on the instance's lease (TTL 3 s by default). The instance renews the lease and
rewrites its heartbeat every interval (0.5 s); when it stops (kill -9, a partition) etcd expires
the lease and deletes both keys, and every gateway's watch sees the deletion. A clean shutdown
revokes the lease first, so gateways stop routing to it at once.

The gateway side (:class:`EtcdRegistry`) reads the prefix once, then watches it from the next
revision: PUT of an instance key adds or replaces an instance, PUT of a heartbeat key applies
load and KV events, DELETE of an instance key removes it. When the watch breaks or etcd
compacted the revision it needed, it reads the prefix again (reconciling: instances no longer
present are removed) and watches from there; KV events missed meanwhile show up as a version
gap and are fetched from the instance itself (``GetKVEvents``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx

from xllm.gateway.engine_client import EngineClient
from xllm.gateway.registry.base import Registry
from xllm.gateway.registry.etcd_client import EtcdClient, EtcdCompacted, EtcdError, EtcdLeaseNotFound, KeyValue
from xllm.proto.registry.v1 import instance_pb2

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/xllm"


def _keys(prefix: str) -> tuple[str, str, str]:
    base = prefix.rstrip("/") + "/"
    return base, base + "instances/", base + "heartbeats/"


class EtcdRegistry(Registry):
    """A gateway's view of the instances registered in etcd under ``prefix``."""

    backend = "etcd"

    def __init__(self, etcd: EtcdClient, prefix: str = DEFAULT_PREFIX,
                 client_factory: Callable[[instance_pb2.InstanceInfo], EngineClient] | None = None,
                 clock: Callable[[], float] = time.monotonic, retry_interval: float = 0.5) -> None:
        super().__init__(client_factory, clock)
        self.etcd = etcd
        self.prefix = prefix
        self._base, self._instances_key, self._heartbeats_key = _keys(prefix)
        self._retry_interval = retry_interval
        self._watcher: asyncio.Task | None = None
        self._synced = asyncio.Event()
        self.resyncs = 0

    async def start(self) -> None:
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._run())

    async def wait_synced(self, timeout: float | None = None) -> None:
        """Wait until the first full read of the prefix was applied."""
        await asyncio.wait_for(self._synced.wait(), timeout)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watcher
            self._watcher = None
        await super().close()
        await self.etcd.close()

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                revision, kvs = await self.etcd.get_prefix(self._base)
                self._reconcile(kvs)
                self._synced.set()
                self.resyncs += 1
                failures = 0
                async for events in self.etcd.watch_prefix(self._base, revision + 1):
                    for ev in events:
                        self._on_change(ev.type, ev.key, ev.value)
            except asyncio.CancelledError:
                raise
            except EtcdCompacted as exc:
                log.info("etcd watch: %s; re-reading the registry", exc)
            except (EtcdError, httpx.HTTPError, ValueError) as exc:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("etcd registry at %s: %s (retrying)", ",".join(self.etcd.endpoints), exc)
                await asyncio.sleep(min(self._retry_interval * failures, 5.0))

    def _reconcile(self, kvs: list[KeyValue]) -> None:
        """Make the view equal to a full read of the prefix."""
        present: set[str] = set()
        heartbeats = []
        for kv in kvs:
            if kv.key.startswith(self._instances_key):
                present.add(kv.key[len(self._instances_key):])
                self._on_change("PUT", kv.key, kv.value)
            elif kv.key.startswith(self._heartbeats_key):
                heartbeats.append(kv)
        for state in self.states():
            if not state.local and state.instance_id not in present:
                self._remove(state.instance_id)
        for kv in heartbeats:
            self._on_change("PUT", kv.key, kv.value)

    def _on_change(self, kind: str, key: str, value: bytes) -> None:
        try:
            if key.startswith(self._instances_key):
                instance_id = key[len(self._instances_key):]
                if kind == "DELETE":
                    self._remove(instance_id)
                else:
                    info = instance_pb2.InstanceInfo.FromString(value)
                    if info.instance_id == instance_id and info.address:
                        self._upsert(info)
            elif key.startswith(self._heartbeats_key) and kind != "DELETE":
                self._heartbeat(instance_pb2.Heartbeat.FromString(value))
        except Exception:  # a malformed value must not stop the watch
            log.exception("etcd registry: cannot apply %s %s", kind, key)


class EtcdPublisher:
    """An instance's side of the etcd backend: lease, info key, heartbeat key."""

    def __init__(self, etcd: EtcdClient, prefix: str = DEFAULT_PREFIX, ttl: float = 3.0) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.ttl = ttl
        _, self._instances_key, self._heartbeats_key = _keys(prefix)
        self.lease: int | None = None
        self._instance_id = ""

    async def register(self, info: instance_pb2.InstanceInfo) -> None:
        lease, _ = await self.etcd.grant(self.ttl)
        try:
            await self.etcd.put(self._instances_key + info.instance_id, info.SerializeToString(), lease)
        except BaseException:
            await self.etcd.revoke(lease)
            raise
        self.lease, self._instance_id = lease, info.instance_id

    async def heartbeat(self, hb: instance_pb2.Heartbeat) -> bool:
        if self.lease is None:
            return False
        try:
            if await self.etcd.keepalive(self.lease) <= 0:
                self.lease = None
                return False
            await self.etcd.put(self._heartbeats_key + self._instance_id, hb.SerializeToString(), self.lease)
        except EtcdLeaseNotFound:
            self.lease = None
            return False
        return True

    async def deregister(self) -> None:
        if self.lease is not None:
            lease, self.lease = self.lease, None
            await self.etcd.revoke(lease)

    async def close(self) -> None:
        await self.etcd.close()

    def describe(self) -> str:
        return f"etcd {','.join(self.etcd.endpoints)} {self.prefix}"
