"""The instance agent through a registry outage: it keeps trying while every call fails, resumes on
the same lease when the registry kept it (etcd restarted on its data dir), and registers again with
a KV snapshot when the registry lost it (etcd restarted without its data)."""

from __future__ import annotations

import asyncio

from xllm.engine_api.registration.agent import InstanceAgent
from xllm.engine_api.registration.etcd_client import EtcdUnavailable
from xllm.proto.kvstore.v1 import kv_events_pb2
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.processes import until

INFO = instance_pb2.InstanceInfo(instance_id="e0", address="127.0.0.1:1")


class FlakyRegistry:
    """A :class:`~xllm.engine_api.registration.agent.Publisher` over a set of leases; while ``down`` every
    call raises like an unreachable etcd."""

    def __init__(self) -> None:
        self.leases: set[int] = set()
        self.lease: int | None = None
        self.next_lease = 100
        self.down = False
        self.failed_calls = 0
        self.beats: list[tuple[int, instance_pb2.Heartbeat]] = []

    def _check(self) -> None:
        if self.down:
            self.failed_calls += 1
            raise EtcdUnavailable("no etcd endpoint answered")

    async def register(self, info: instance_pb2.InstanceInfo) -> None:
        self._check()
        self.next_lease += 1
        self.lease = self.next_lease
        self.leases.add(self.lease)

    async def heartbeat(self, hb: instance_pb2.Heartbeat) -> bool:
        self._check()
        if self.lease not in self.leases:
            self.lease = None
            return False
        self.beats.append((self.lease, hb))
        return True

    async def deregister(self) -> None:
        self.leases.discard(self.lease)

    async def close(self) -> None:
        pass

    def describe(self) -> str:
        return "flaky registry"


class Source:
    """Heartbeats whose KV version grows by one each time, a delta from the version asked for (its
    ``base_version``) or a snapshot."""

    def __init__(self) -> None:
        self.version = 0

    def heartbeat(self, kv_since, seq=0):
        self.version += 1
        return instance_pb2.Heartbeat(instance_id="e0", seq=seq, kv_events=kv_events_pb2.KVCacheEvents(
            epoch=7, version=self.version, base_version=kv_since or 0, snapshot=kv_since is None))


def test_the_agent_rides_out_an_outage_on_its_lease_or_registers_again_with_a_snapshot():
    async def run():
        registry, source = FlakyRegistry(), Source()
        agent = InstanceAgent(source, INFO, registry, interval=0.01)
        await agent.start()
        try:
            await until(lambda: len(registry.beats) >= 3, 10, "heartbeats")
            first_lease = registry.lease

            # 1) etcd down, then back with its data: the same lease, a delta from the last acknowledged version
            registry.down = True
            await until(lambda: registry.failed_calls >= 5, 10, "calls failing while the registry is down")
            acked = registry.beats[-1][1].kv_events.version
            n = len(registry.beats)
            registry.down = False
            await until(lambda: len(registry.beats) > n, 10, "heartbeats after the outage")
            lease, hb = registry.beats[n]
            assert lease == first_lease and agent.registrations == 1
            assert not hb.kv_events.snapshot and hb.kv_events.base_version == acked  # nothing lost in between

            # 2) etcd down, then back without its data: a new lease, starting with a snapshot
            registry.down = True
            await until(lambda: registry.failed_calls >= 10, 10, "calls failing again")
            registry.leases.clear()
            n = len(registry.beats)
            registry.down = False
            await until(lambda: agent.registrations == 2 and len(registry.beats) > n, 10, "registered again")
            lease, hb = registry.beats[n]
            assert lease != first_lease and lease in registry.leases
            assert hb.kv_events.snapshot
        finally:
            await agent.stop(deregister=True)

    asyncio.run(run())
