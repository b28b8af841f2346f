"""Registering an instance: the agent's heartbeats and re-registration, the embedded registry's
RegistryService over gRPC (both sides), the etcd key layout and client helpers."""

from __future__ import annotations

import asyncio

import pytest

from xllm.engine_api.registration.agent import InstanceAgent
from xllm.engine_api.registration.embedded import GrpcRegistryPublisher, serve_registry
from xllm.engine_api.registration.etcd import EtcdLayout
from xllm.engine_api.registration.etcd_client import parse_endpoints, prefix_range_end
from xllm.proto.kvstore.v1 import kv_events_pb2
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.processes import until
from xllm.testing.registry import LocalPublisher


class Leases:
    """A lease table (xllm.engine_api.registration.embedded.LeaseTable) recording what it was told."""

    def __init__(self) -> None:
        self.infos: dict[int, instance_pb2.InstanceInfo] = {}
        self.beats: list[instance_pb2.Heartbeat] = []
        self.next_id = 1

    def grant(self, info, ttl):
        lease, self.next_id = self.next_id, self.next_id + 1
        self.infos[lease] = instance_pb2.InstanceInfo()
        self.infos[lease].CopyFrom(info)
        return lease, ttl

    def keepalive(self, lease_id, heartbeat=None):
        if lease_id not in self.infos:
            return False
        if heartbeat is not None:
            self.beats.append(heartbeat)
        return True

    def revoke(self, lease_id):
        self.infos.pop(lease_id, None)


class Source:
    """Builds heartbeats like an EngineServer: a KV version that grows with every heartbeat."""

    def __init__(self) -> None:
        self.version = 0
        self.asked: list[int | None] = []

    def heartbeat(self, kv_since, seq=0):
        self.asked.append(kv_since)
        self.version += 1
        return instance_pb2.Heartbeat(instance_id="e0", seq=seq, kv_events=kv_events_pb2.KVCacheEvents(
            epoch=7, version=self.version, snapshot=kv_since is None))


INFO = instance_pb2.InstanceInfo(instance_id="e0", address="127.0.0.1:1")


def test_agent_acknowledges_deltas_and_registers_again_when_the_lease_is_lost():
    async def run():
        leases, source = Leases(), Source()
        agent = InstanceAgent(source, INFO, LocalPublisher(leases), interval=0.01)
        await agent.start()
        assert agent.registered and agent.registrations == 1
        assert source.asked[0] is None  # a new registration starts with a snapshot
        assert await agent.beat()
        assert source.asked[-1] == source.version - 1  # then deltas since the acknowledged version
        leases.infos.clear()  # the registry forgot the lease (it restarted)
        await until(lambda: agent.registrations == 2, 10, "the agent to register again")
        assert agent.registrations == 2 and list(leases.infos.values()) == [INFO]
        await agent.stop(deregister=True)
        assert not leases.infos and not agent.registered

    asyncio.run(run())


def test_registry_service_over_grpc_both_sides():
    async def run():
        leases = Leases()
        server, port = await serve_registry(leases, "127.0.0.1", 0)
        publisher = GrpcRegistryPublisher(f"127.0.0.1:{port}", ttl=2.0)
        try:
            assert not await publisher.heartbeat(instance_pb2.Heartbeat(instance_id="e0"))  # not registered yet
            await publisher.register(INFO)
            assert list(leases.infos.values()) == [INFO]
            assert await publisher.heartbeat(instance_pb2.Heartbeat(instance_id="e0", seq=3))
            assert leases.beats[-1].seq == 3
            await publisher.deregister()
            assert not leases.infos
            await publisher.register(INFO)
            leases.infos.clear()  # lease gone on the registry side: the heartbeat says so
            assert not await publisher.heartbeat(instance_pb2.Heartbeat(instance_id="e0"))
            assert publisher.lease is None
            assert "127.0.0.1" in publisher.describe()
        finally:
            await publisher.close()
            await server.stop(0)

    asyncio.run(run())


def test_etcd_layout_and_helpers():
    layout = EtcdLayout("/xllm/")
    assert (layout.base, layout.instances, layout.heartbeats) == ("/xllm/", "/xllm/instances/", "/xllm/heartbeats/")
    assert EtcdLayout().instances == "/xllm/instances/"
    assert prefix_range_end("/xllm/") == b"/xllm0"
    assert prefix_range_end("ab") == b"ac"
    assert parse_endpoints("h1:1, http://h2:2/") == ["http://h1:1", "http://h2:2"]
    with pytest.raises(ValueError):
        parse_endpoints(" , ")
