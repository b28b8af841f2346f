"""The gateway's etcd view over a scripted etcd client: a silent watch is restarted, the view is
kept while etcd is unreachable and reconciled when it answers again, and instances missing after
etcd lost its data get a grace to register again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, generate_latest

from xllm.engine_api.registration.etcd_client import (
    EtcdError,
    EtcdUnavailable,
    EtcdWatchTimeout,
    KeyValue,
    WatchEvent,
    WatchResponse,
)
from xllm.gateway.metrics import RegistryMetrics
from xllm.gateway.registry import EtcdRegistry
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.processes import until

PREFIX = "/p"


class StubClient:
    def __init__(self, info: instance_pb2.InstanceInfo) -> None:
        self.info = info
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class ScriptedEtcd:
    """The calls :class:`EtcdRegistry` makes, over a dict; ``down`` makes every call fail,
    ``break_watch`` ends the open watch with an error, and a watch nobody writes to stays silent."""

    endpoint = "http://scripted:2379"

    def __init__(self) -> None:
        self.endpoints = [self.endpoint]
        self.kvs: dict[str, bytes] = {}
        self.revision = 1
        self.down = False
        self.failed_reads = 0
        self.watches = 0
        self._queue: asyncio.Queue | None = None

    def put(self, key: str, value: bytes) -> None:
        self.revision += 1
        self.kvs[key] = value
        self._send(WatchResponse(self.revision, (WatchEvent("PUT", key, value, self.revision),)))

    def delete(self, key: str) -> None:
        self.revision += 1
        self.kvs.pop(key, None)
        self._send(WatchResponse(self.revision, (WatchEvent("DELETE", key, b"", self.revision),)))

    def break_watch(self) -> None:
        self._send(EtcdError("connection reset"))

    def _send(self, item) -> None:
        if self._queue is not None:
            self._queue.put_nowait(item)

    async def get_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        if self.down:
            self.failed_reads += 1
            raise EtcdUnavailable("down")
        return self.revision, [KeyValue(k, v, self.revision) for k, v in sorted(self.kvs.items())
                               if k.startswith(prefix)]

    async def watch_prefix(self, prefix: str, start_revision: int,
                           idle_timeout: float | None = None) -> AsyncIterator[WatchResponse]:
        if self.down:
            raise EtcdUnavailable("down")
        self.watches += 1
        self._queue = queue = asyncio.Queue()
        yield WatchResponse(self.revision, created=True)
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), idle_timeout)
            except TimeoutError:
                raise EtcdWatchTimeout(idle_timeout) from None
            if isinstance(item, Exception):
                raise item
            yield item

    async def close(self) -> None:
        pass


def info(iid: str) -> bytes:
    return instance_pb2.InstanceInfo(instance_id=iid, address=f"127.0.0.1:{50000 + int(iid[1:])}",
                                     model=instance_pb2.ModelInfo(served_name="m", block_size=4)).SerializeToString()


def key(iid: str) -> str:
    return f"{PREFIX}/instances/{iid}"


def registry_over(etcd: ScriptedEtcd, **kw) -> tuple[EtcdRegistry, CollectorRegistry]:
    prom = CollectorRegistry()
    reg = EtcdRegistry(etcd, PREFIX, client_factory=StubClient, retry_interval=0.01, max_retry_interval=0.02,
                       metrics=RegistryMetrics(prom), **kw)
    return reg, prom


def ids(reg: EtcdRegistry) -> set[str]:
    return {s.instance_id for s in reg.states()}


def test_the_view_is_kept_while_etcd_is_down_and_reconciled_when_it_answers():
    async def run():
        etcd = ScriptedEtcd()
        for iid in ("e0", "e1"):
            etcd.put(key(iid), info(iid))
        reg, prom = registry_over(etcd, watch_timeout=30.0)
        await reg.start()
        try:
            await until(lambda: reg.watch_up, 10, "the watch")
            assert ids(reg) == {"e0", "e1"}
            etcd.down = True
            etcd.break_watch()
            await until(lambda: etcd.failed_reads >= 3, 10, "reads retried while etcd is down")
            assert ids(reg) == {"e0", "e1"} and not reg.watch_up  # routing goes on with the last view
            assert reg.watch_restarts == {"error": 1}
            etcd.down = False
            etcd.kvs.pop(key("e1"))  # its lease expired meanwhile (etcd kept its data)
            await until(lambda: reg.watch_up, 10, "the watch again")
            assert ids(reg) == {"e0"}  # reconciled with the read: nothing waits for e1
            etcd.put(key("e2"), info("e2"))  # and the new watch carries changes
            await until(lambda: "e2" in ids(reg), 10, "e2 through the new watch")
            text = generate_latest(prom).decode()
            assert 'xllm:registry_watch_restarts_total{reason="error"} 1.0' in text
            assert "xllm:registry_watch_up 1.0" in text
        finally:
            await reg.close()

    asyncio.run(run())


def test_a_silent_watch_counts_as_dead_and_is_restarted_from_a_fresh_read():
    async def run():
        etcd = ScriptedEtcd()
        etcd.put(key("e0"), info("e0"))
        reg, prom = registry_over(etcd, watch_timeout=0.2)
        await reg.start()
        try:
            await until(lambda: reg.watch_restarts.get("timeout", 0) >= 2, 10, "two silent watches restarted")
            assert reg.resyncs >= 3 and etcd.watches >= 3 and ids(reg) == {"e0"}
            assert 'xllm:registry_watch_restarts_total{reason="timeout"}' in generate_latest(prom).decode()
        finally:
            await reg.close()

    asyncio.run(run())


def test_instances_missing_after_etcd_lost_its_data_get_a_grace_to_register_again():
    async def run():
        etcd = ScriptedEtcd()
        for iid in ("e0", "e1"):
            etcd.put(key(iid), info(iid))
        etcd.revision = 50
        reg, _ = registry_over(etcd, watch_timeout=30.0, rejoin_grace=0.5)
        await reg.start()
        try:
            await until(lambda: reg.watch_up, 10, "the watch")
            e0 = reg.get("e0")
            # etcd comes back without its data: empty, at an older revision
            etcd.kvs.clear()
            etcd.revision = 2
            etcd.break_watch()
            await until(lambda: reg.resyncs == 2, 10, "the read after the restart")
            assert ids(reg) == {"e0", "e1"}  # both kept for now
            etcd.put(key("e0"), info("e0"))  # e0's agent registers again; e1 never does
            await until(lambda: reg.get("e1") is None, 10, "e1 dropped after the grace")
            assert reg.get("e0") is e0 and not e0.removed and not e0.client.closed  # the same state, untouched
        finally:
            await reg.close()

    asyncio.run(run())
