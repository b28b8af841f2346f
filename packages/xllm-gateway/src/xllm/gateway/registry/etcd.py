"""The gateway side of the etcd registry backend: a watch over the instances registered in etcd.

The key layout and the instance side (lease, info and heartbeat keys) are in
:mod:`xllm.engine_api.registration.etcd`. :class:`EtcdRegistry` reads the prefix once, then watches it
from the next revision: PUT of an instance key adds or replaces an instance, PUT of a heartbeat
key applies load and KV events, DELETE of an instance key removes it. When the watch breaks, stays
silent for ``watch_timeout`` s (a frozen etcd, a dead connection: etcd is asked for progress
notifications, and every instance heartbeats twice a second, so a live watch is never silent for
long) or etcd compacted the revision it needed, it reads the prefix again (reconciling: instances
no longer present are removed) and watches from there; KV events missed meanwhile show up as a
version gap and are fetched from the instance itself (``GetKVEvents``).

While etcd cannot be reached the view stays as it was: nothing is removed for an outage (leases
cannot be seen to expire either); an instance that fails requests meanwhile is the routing
failure path's business. The read is retried (backoff up to ``max_retry_interval``) until etcd
answers. A read whose revision is older than one already seen means etcd lost its data
(restarted without its data dir, or another cluster): instances missing from it get
``rejoin_grace`` s to register again (their agents do at their next heartbeat) before they are
removed, so a gateway does not drop every instance for the moment between etcd's return and their
re-registration.

With a credential (the cluster token's keys), an instance key counts only if its record is signed
with it for the very lease the key hangs on (:func:`xllm.engine_api.credential.verify_record`): an
unsigned record, one signed with another credential and a stale record written again (under another
lease or none: the lease it was signed for is gone, and etcd refuses writes under an unknown lease)
are refused, counted and treated as absent; a heartbeat key counts only under the lease of its
instance's verified record, signed for it, with a seq above the last one applied
(:meth:`~xllm.gateway.registry.base.Registry.heartbeat_trusted`): a writer who reads the live lease can
neither forge a heartbeat (load, KV events, draining) nor write an old one again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx

from xllm.engine_api.client import EngineClient
from xllm.engine_api.credential import ClusterKeys
from xllm.engine_api.registration.etcd import DEFAULT_PREFIX, EtcdLayout
from xllm.engine_api.registration.etcd_client import (
    DEFAULT_WATCH_TIMEOUT,
    EtcdClient,
    EtcdCompacted,
    EtcdError,
    EtcdWatchTimeout,
    KeyValue,
)
from xllm.gateway.metrics import RegistryMetrics
from xllm.gateway.registry.base import Registry
from xllm.proto.registry.v1 import instance_pb2

log = logging.getLogger(__name__)


class EtcdRegistry(Registry):
    """A gateway's view of the instances registered in etcd under ``prefix``.

    ``watch_timeout``: seconds the watch may stay silent before it counts as dead and is restarted;
    ``rejoin_grace``: how long instances missing after etcd lost its data may take to register
    again; ``metrics``: where watch restarts and the watch's state are counted (``xllm:registry_*``).
    """

    backend = "etcd"

    def __init__(self, etcd: EtcdClient, prefix: str = DEFAULT_PREFIX,
                 client_factory: Callable[[instance_pb2.InstanceInfo], EngineClient] | None = None,
                 clock: Callable[[], float] = time.monotonic, retry_interval: float = 0.5,
                 max_retry_interval: float = 2.0, watch_timeout: float = DEFAULT_WATCH_TIMEOUT,
                 rejoin_grace: float = 10.0, metrics: RegistryMetrics | None = None,
                 credential: ClusterKeys | None = None) -> None:
        super().__init__(client_factory, clock, credential, metrics)
        if watch_timeout <= 0:
            raise ValueError(f"etcd watch timeout must be > 0, got {watch_timeout}")
        self.etcd = etcd
        self.prefix = prefix
        layout = EtcdLayout(prefix)
        self._base, self._instances_key, self._heartbeats_key = layout.base, layout.instances, layout.heartbeats
        self._retry_interval = retry_interval
        self._max_retry_interval = max_retry_interval
        self.watch_timeout = watch_timeout
        self.rejoin_grace = rejoin_grace
        self._watcher: asyncio.Task | None = None
        self._synced = asyncio.Event()
        self._revision = 0                         # the newest store revision seen
        self._rejoining: set[str] = set()          # missing after etcd lost its data: kept for now
        self._rejoin_timer: asyncio.TimerHandle | None = None
        self.resyncs = 0                           # full reads of the prefix applied
        self.watch_restarts: dict[str, int] = {}   # by reason: timeout, error, compacted
        self.watch_up = False                      # a watch is established (etcd confirmed it)

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
        if self._rejoin_timer is not None:
            self._rejoin_timer.cancel()
            self._rejoin_timer = None
        await super().close()
        await self.etcd.close()

    async def _run(self) -> None:
        failures = 0
        while True:
            watching = False
            try:
                revision, kvs = await self.etcd.get_prefix(self._base)
                if failures:
                    log.info("etcd registry at %s: reachable again", self.etcd.endpoint)
                failures = 0
                self._apply_read(revision, kvs)
                watching = True
                watch = self.etcd.watch_prefix(self._base, revision + 1, idle_timeout=self.watch_timeout)
                async with contextlib.aclosing(watch):
                    async for resp in watch:
                        if resp.created:
                            self._set_watch_up(True)
                        self._revision = max(self._revision, resp.revision)
                        for ev in resp.events:
                            self._on_change(ev.type, ev.key, ev.value, ev.lease)
            except asyncio.CancelledError:
                self._set_watch_up(False)
                raise
            except EtcdCompacted as exc:
                log.info("etcd watch: %s; re-reading the registry", exc)
                self._watch_ended("compacted")
                continue
            except EtcdWatchTimeout as exc:
                # with instances heartbeating, silence means a dead stream; an empty prefix on an etcd
                # that sends no progress notifications is just quiet
                quiet = not any(not s.local for s in self.states())
                log.log(logging.DEBUG if quiet else logging.WARNING, "etcd registry at %s: %s; re-reading the "
                        "registry", self.etcd.endpoint, exc)
                self._watch_ended("timeout")
                continue
            except (EtcdError, httpx.HTTPError, ValueError) as exc:
                if watching:
                    self._watch_ended("error")
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("etcd registry at %s: %s (retrying; the view stays as it is)",
                                ",".join(self.etcd.endpoints), exc)
                await asyncio.sleep(min(self._retry_interval * failures, self._max_retry_interval))

    def _watch_ended(self, reason: str) -> None:
        self._set_watch_up(False)
        self.watch_restarts[reason] = self.watch_restarts.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.watch_restarted(reason)

    def _set_watch_up(self, up: bool) -> None:
        self.watch_up = up
        if self.metrics is not None:
            self.metrics.set_watch_up(up)

    def _apply_read(self, revision: int, kvs: list[KeyValue]) -> None:
        """Apply a full read of the prefix taken at store ``revision``."""
        lost = revision < self._revision
        if lost:
            log.warning("etcd registry: etcd is at revision %d after %d: it lost its data; instances get %g s "
                        "to register again", revision, self._revision, self.rejoin_grace)
        self._revision = revision
        self._reconcile(kvs, lost)
        self._synced.set()
        self.resyncs += 1

    def _reconcile(self, kvs: list[KeyValue], lost: bool = False) -> None:
        """Make the view equal to a full read of the prefix (``lost``: etcd lost its data, so
        instances missing from the read are kept for ``rejoin_grace`` s)."""
        present: set[str] = set()
        heartbeats = []
        for kv in kvs:
            if kv.key.startswith(self._instances_key):
                if self._on_change("PUT", kv.key, kv.value, kv.lease):
                    present.add(kv.key[len(self._instances_key):])
            elif kv.key.startswith(self._heartbeats_key):
                heartbeats.append(kv)
        missing = {s.instance_id for s in self.states() if not s.local and s.instance_id not in present}
        if lost and missing:
            self._rejoining |= missing
            if self._rejoin_timer is not None:
                self._rejoin_timer.cancel()
            self._rejoin_timer = asyncio.get_running_loop().call_later(self.rejoin_grace, self._end_rejoin)
        for instance_id in missing - self._rejoining:
            self._remove(instance_id)
        for kv in heartbeats:
            self._on_change("PUT", kv.key, kv.value, kv.lease)

    def _end_rejoin(self) -> None:
        """The grace after etcd lost its data is over: drop the instances that did not come back."""
        self._rejoin_timer = None
        gone, self._rejoining = self._rejoining, set()
        for instance_id in gone:
            log.info("instance %s did not register again after etcd lost its data", instance_id)
            self._remove(instance_id)

    def _on_change(self, kind: str, key: str, value: bytes, lease: int = 0) -> bool:
        """Apply one key's change (``lease``: the one it hangs on); returns whether an instance key
        now holds an accepted record (a refused one removes the instance it names)."""
        try:
            if key.startswith(self._instances_key):
                instance_id = key[len(self._instances_key):]
                self._rejoining.discard(instance_id)
                if kind == "DELETE":
                    self._remove(instance_id)
                    return False
                info = instance_pb2.InstanceInfo.FromString(value)
                if info.instance_id == instance_id and info.address and self._verified(info, lease):
                    self._upsert(info)
                    return True
                self._remove(instance_id)
            elif key.startswith(self._heartbeats_key) and kind != "DELETE":
                hb = instance_pb2.Heartbeat.FromString(value)
                state = self.get(hb.instance_id)
                if self.credential is None or (state is not None and not state.local
                                               and lease == state.info.signature.lease
                                               and key == self._heartbeats_key + hb.instance_id
                                               and self.heartbeat_trusted(state, hb, lease)):
                    self._heartbeat(hb)
        except Exception:  # a malformed value must not stop the watch
            log.exception("etcd registry: cannot apply %s %s", kind, key)
        return False
