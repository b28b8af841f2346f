"""The gateway side of the etcd registry backend: a watch over the instances registered in etcd.

The key layout and the instance side (lease, info and heartbeat keys) are in
:mod:`xllm.engine.registration.etcd`. :class:`EtcdRegistry` reads the prefix once, then watches it
from the next revision: PUT of an instance key adds or replaces an instance, PUT of a heartbeat
key applies load and KV events, DELETE of an instance key removes it. When the watch breaks or
etcd compacted the revision it needed, it reads the prefix again (reconciling: instances no
longer present are removed) and watches from there; KV events missed meanwhile show up as a
version gap and are fetched from the instance itself (``GetKVEvents``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx

from xllm.engine.client import EngineClient
from xllm.engine.registration.etcd import DEFAULT_PREFIX, EtcdLayout
from xllm.engine.registration.etcd_client import EtcdClient, EtcdCompacted, EtcdError, KeyValue
from xllm.gateway.registry.base import Registry
from xllm.proto.registry.v1 import instance_pb2

log = logging.getLogger(__name__)


class EtcdRegistry(Registry):
    """A gateway's view of the instances registered in etcd under ``prefix``."""

    backend = "etcd"

    def __init__(self, etcd: EtcdClient, prefix: str = DEFAULT_PREFIX,
                 client_factory: Callable[[instance_pb2.InstanceInfo], EngineClient] | None = None,
                 clock: Callable[[], float] = time.monotonic, retry_interval: float = 0.5) -> None:
        super().__init__(client_factory, clock)
        self.etcd = etcd
        self.prefix = prefix
        layout = EtcdLayout(prefix)
        self._base, self._instances_key, self._heartbeats_key = layout.base, layout.instances, layout.heartbeats
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
