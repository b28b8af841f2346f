"""The gateway's side of the cluster's security: the embedded registry's hardening (random lease ids,
bounded TTLs, no take-over of a live instance id, heartbeats only for the lease's own instance) in
the lease table and over ``RegistryService`` with a cluster token (an engine's agent still registers
again after losing its lease), and an engine refusing the gateway's token read as a configuration
error by the dispatcher, not as a dead instance."""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import re
import secrets

import grpc
import pytest

from xllm.engine_api.client import GrpcEngineClient
from xllm.engine_api.registration.agent import InstanceAgent
from xllm.engine_api.registration.embedded import (
    MAX_TTL,
    MIN_TTL,
    GrpcRegistryPublisher,
    LeaseConflictError,
    RegistrationRefusedError,
    serve_registry,
)
from xllm.engine_api.security import ClusterSecurity
from xllm.engine_api.wire import ClusterAuthError
from xllm.gateway.cluster import ClusterOptions, build_cluster
from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.openai.errors import APIError
from xllm.gateway.registry import EmbeddedRegistry
from xllm.gateway.router import Router
from xllm.proto.registry.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from xllm.testing.engine import make_engine, make_request
from xllm.testing.processes import until
from xllm.testing.served import ServedEngine

TOKEN = secrets.token_urlsafe(24)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class StubClient:
    def __init__(self, info: instance_pb2.InstanceInfo) -> None:
        self.info = info

    async def close(self) -> None:
        pass


class Source:
    """Heartbeats of instance ``iid`` (what an EngineServer builds), counted."""

    def __init__(self, iid: str) -> None:
        self.iid = iid
        self.beats = 0

    def heartbeat(self, kv_since, seq=0):
        self.beats += 1
        return instance_pb2.Heartbeat(instance_id=self.iid, seq=seq)


def info(iid: str, address: str = "127.0.0.1:7001") -> instance_pb2.InstanceInfo:
    return instance_pb2.InstanceInfo(instance_id=iid, address=address,
                                     model=instance_pb2.ModelInfo(served_name="m", block_size=4, max_model_len=64))


def test_lease_ids_are_random_and_distinct():
    reg = EmbeddedRegistry(client_factory=StubClient)
    ids = [reg.grant(info(f"e{i}", f"127.0.0.1:{7000 + i}"), 3.0)[0] for i in range(64)]
    assert len(set(ids)) == 64 and all(0 < i < 2**63 for i in ids)
    steps = {b - a for a, b in itertools.pairwise(ids)}
    assert len(steps) > 32  # not a counter (a counter's steps are all 1)
    assert sum(i >= 2**48 for i in ids) > 60  # spread over 63 bits (a few below 2**48: chance ~1/2**15 each)


def test_ttls_are_clamped_and_nonsense_refused():
    reg = EmbeddedRegistry(client_factory=StubClient)
    assert reg.grant(info("a", "h:1"), 0.01)[1] == MIN_TTL == 1.0
    assert reg.grant(info("b", "h:2"), 10**9)[1] == MAX_TTL == 60.0
    assert reg.grant(info("c", "h:3"), 3.0)[1] == 3.0
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            reg.grant(info("d", "h:4"), bad)
    assert reg.get("d") is None


def test_a_live_instance_id_cannot_be_taken_over():
    clock = Clock()
    reg = EmbeddedRegistry(client_factory=StubClient, clock=clock)
    lease, _ = reg.grant(info("e0", "10.0.0.7:50051"), 3.0)
    with pytest.raises(LeaseConflictError, match=re.escape("10.0.0.7:50051")):
        reg.grant(info("e0", "10.6.6.6:50051"), 3.0)
    assert reg.get("e0").info.address == "10.0.0.7:50051"  # traffic still goes to the holder
    assert reg.keepalive(lease, instance_pb2.Heartbeat(instance_id="e0"))  # whose lease still works
    # the holder registering again (same address: only one process listens there) replaces its lease
    again, _ = reg.grant(info("e0", "10.0.0.7:50051"), 3.0)
    assert again != lease and not reg.keepalive(lease) and reg.keepalive(again)
    # once the holder's lease expired (or it deregistered), another process may take the id
    clock.t += 3.5
    moved, _ = reg.grant(info("e0", "10.0.0.8:50051"), 3.0)
    assert reg.get("e0").info.address == "10.0.0.8:50051" and not reg.keepalive(again)
    reg.revoke(moved)
    reg.grant(info("e0", "10.0.0.9:50051"), 3.0)
    assert reg.get("e0").info.address == "10.0.0.9:50051"


def test_heartbeats_count_only_for_the_lease_of_their_instance():
    clock = Clock()
    reg = EmbeddedRegistry(client_factory=StubClient, clock=clock)
    la, _ = reg.grant(info("a", "h:1"), 3.0)
    lb, _ = reg.grant(info("b", "h:2"), 3.0)
    clock.t += 2.0
    assert not reg.keepalive(lb, instance_pb2.Heartbeat(instance_id="a", draining=True))  # b's lease, a's name
    assert reg.get("a").heartbeats == 0 and not reg.get("a").draining
    assert reg.keepalive(la, instance_pb2.Heartbeat(instance_id="a"))
    clock.t += 2.0
    assert reg.expire() == ["b"]  # the refused heartbeat did not renew b's lease
    reg.revoke(secrets.randbits(63))  # a guessed lease id revokes nothing
    assert [s.instance_id for s in reg.states()] == ["a"]


def test_registry_service_with_a_token():
    """Over gRPC: the token is required on every call; a take-over is ALREADY_EXISTS and a bad TTL
    INVALID_ARGUMENT (both raised as RegistrationRefusedError); the real engine's agent keeps
    its registration, and registers again after losing its lease."""
    security = ClusterSecurity(token=TOKEN)

    async def main():
        clock = Clock()
        reg = EmbeddedRegistry(client_factory=StubClient, clock=clock)
        server, port = await serve_registry(reg, "127.0.0.1", 0, security)
        address = f"127.0.0.1:{port}"
        publishers = []

        def publisher(sec=security, ttl=3.0) -> GrpcRegistryPublisher:
            publishers.append(GrpcRegistryPublisher(address, ttl, security=sec))
            return publishers[-1]

        source = Source("e0")
        agent = InstanceAgent(source, info("e0", "127.0.0.1:7001"), publisher(), interval=0.02)
        try:
            for sec in (ClusterSecurity(), ClusterSecurity(token=secrets.token_urlsafe(24))):
                with pytest.raises(RegistrationRefusedError, match="UNAUTHENTICATED"):
                    await publisher(sec).register(info("x", "127.0.0.1:7009"))
            with pytest.raises(RegistrationRefusedError, match="INVALID_ARGUMENT"):
                await publisher(ttl=-5.0).register(info("x", "127.0.0.1:7009"))
            assert reg.states() == []

            await agent.start()
            assert agent.registered and reg.get("e0").info.address == "127.0.0.1:7001"
            lease = agent.publisher.lease
            hijacker = publisher()
            with pytest.raises(RegistrationRefusedError, match="ALREADY_EXISTS"):
                await hijacker.register(info("e0", "127.0.0.1:6666"))
            async with grpc.aio.insecure_channel(address) as channel:  # no token: refused before the servicer
                stub = registry_pb2_grpc.RegistryServiceStub(channel)
                for call in (stub.Deregister(registry_pb2.DeregisterRequest(lease_id=lease)),
                             stub.Heartbeat(registry_pb2.HeartbeatRequest(lease_id=lease))):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            beats = source.beats
            await until(lambda: source.beats > beats + 3, 10, "heartbeats going on")
            assert reg.get("e0").info.address == "127.0.0.1:7001" and agent.registrations == 1

            clock.t += 10  # the lease expired (a long pause): the agent's next heartbeat hears so
            await until(lambda: agent.registrations == 2, 10, "the agent to register again")
            assert agent.publisher.lease != lease and reg.get("e0").info.address == "127.0.0.1:7001"
            await agent.stop(deregister=True)
            assert reg.get("e0") is None
        finally:
            await agent.stop(deregister=False)
            for p in publishers:
                await p.close()
            await server.stop(0)
            await reg.close()

    asyncio.run(main())


def test_an_engine_refusing_the_gateways_token_is_a_configuration_error_not_a_dead_instance():
    """The dispatcher answers 500 at once (from a ClusterAuthError naming the flag); it neither marks
    the instance failed nor tries another one (which would refuse as well)."""

    async def main():
        registry = EmbeddedRegistry(client_factory=functools.partial(
            GrpcEngineClient, security=ClusterSecurity(token=secrets.token_urlsafe(24))))
        served = await ServedEngine(make_engine(), model="tiny", security=ClusterSecurity(token=TOKEN)).start(registry)
        try:
            router, failed = Router(registry), []
            router.failed = failed.append  # what the dispatcher reports as a failed instance
            dispatcher = Dispatcher(registry, "tiny", router)
            with pytest.raises(APIError) as refused:
                await dispatcher.submit_all("tiny", [make_request("r", [5, 6, 7], max_tokens=2)])
            routable = [s.instance_id for s in registry.routable("tiny")]
            return refused.value, failed, routable, served.server.counters().finished_requests
        finally:
            await served.stop()
            await registry.close()

    error, failed, routable, finished = asyncio.run(main())
    assert error.status == 500
    assert isinstance(error.__cause__, ClusterAuthError) and "--cluster-token" in str(error.__cause__)
    assert failed == [] and routable == ["engine-0"] and finished == 0


def test_serve_instances_with_a_server_certificate_needs_the_ca_to_dial_its_engines():
    with pytest.raises(ValueError, match="--tls-ca"):  # checked before the model is even resolved
        build_cluster(ClusterOptions(model="/nonexistent", instances={"mixed": 1},
                                     security=ClusterSecurity(tls_cert="c.pem", tls_key="k.pem")))
