"""Members prove who they are (issue 50, item 1), on a real etcd and a served tiny engine with a cluster
token, attacked by a process that can write to etcd and listens on a port of its own:

- instance records that are unsigned, signed with another credential, or a stale signed record written
  again under another lease (or none) never join the gateway's view (refused, counted by reason), so the
  fake server never receives a request, a per-call proof nor the token;
- a correctly signed record of a fake's address joins, but the gateway's client challenges it (``Prove``)
  before anything else, and the fake, unable to answer, receives only that challenge;
- the real engine's signed record joins and serves;
- a per-call proof captured on the wire is refused when replayed;
- the embedded registry refuses unsigned and stale registrations.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from xllm.engine_api.client import GrpcEngineClient
from xllm.engine_api.credential import PROOF_KEY, ClusterKeys, make_proof, sign_record
from xllm.engine_api.registration.agent import InstanceAgent
from xllm.engine_api.registration.embedded import GrpcRegistryPublisher, RegistrationRefusedError, serve_registry
from xllm.engine_api.registration.etcd import EtcdLayout, EtcdPublisher
from xllm.engine_api.registration.etcd_client import EtcdClient, EtcdError
from xllm.engine_api.security import ClusterSecurity, open_channel
from xllm.engine_api.wire import ClusterAuthError
from xllm.gateway.metrics import RegistryMetrics
from xllm.gateway.registry import EmbeddedRegistry, EtcdRegistry
from xllm.proto.engine.v1 import engine_pb2, engine_pb2_grpc
from xllm.proto.registry.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from xllm.testing.engine import generate, make_engine, make_request
from xllm.testing.processes import until
from xllm.testing.served import ServedEngine
from xllm.testing.tiny import TinyLM

TOKEN = secrets.token_urlsafe(32)
SECURITY = ClusterSecurity(token=TOKEN)
OTHER = ClusterKeys.from_token(secrets.token_urlsafe(32))
PREFIX = "/trust"
MODEL = TinyLM()
PROMPT = [5, 6, 7, 8, 9, 10]
SECRETS = (TOKEN.encode(), SECURITY.keys.record, SECURITY.keys.call, SECURITY.keys.prove)


class FakeEngine(grpc.GenericRpcHandler):
    """An attacker's ``EngineService``: records every call it gets (method, metadata, request bytes), would
    stream tokens to any ``Generate``, and answers ``Prove`` with what it can: a made-up MAC."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, bytes]] = []

    def service(self, details: grpc.HandlerCallDetails):
        method = details.method

        def record(request: bytes) -> None:
            self.calls.append((method, tuple(details.invocation_metadata or ()), request))

        if method.endswith("/Prove"):
            def prove(request: bytes, context) -> bytes:
                record(request)
                return engine_pb2.ProveResponse(instance_id="fake", address="x", mac=b"\0" * 32).SerializeToString()
            return grpc.unary_unary_rpc_method_handler(prove)

        if method.endswith("/Generate"):
            async def stream(request: bytes, context):
                record(request)
                yield engine_pb2.GenerateResponse(token_ids=[1]).SerializeToString()
            return grpc.unary_stream_rpc_method_handler(stream)

        def other(request: bytes, context) -> bytes:
            record(request)
            return b""
        return grpc.unary_unary_rpc_method_handler(other)


def info(iid: str, address: str) -> instance_pb2.InstanceInfo:
    return instance_pb2.InstanceInfo(instance_id=iid, address=address, role=instance_pb2.INSTANCE_ROLE_MIXED,
                                     model=instance_pb2.ModelInfo(served_name="tiny", block_size=16,
                                                                  max_model_len=64))



def test_fake_instances_in_etcd_get_nothing_and_a_signed_real_engine_serves(etcd):
    expected = generate(make_engine(MODEL), [make_request("ref", PROMPT, max_tokens=5, ignore_eos=True)]).tokens["ref"]

    async def main():
        fake, fake_server = FakeEngine(), grpc.aio.server()
        fake_server.add_generic_rpc_handlers((fake,))
        fake_address = f"127.0.0.1:{fake_server.add_insecure_port('127.0.0.1:0')}"
        await fake_server.start()
        metrics = RegistryMetrics(CollectorRegistry())
        registry = EtcdRegistry(EtcdClient(etcd.endpoint), PREFIX, metrics=metrics, credential=SECURITY.keys,
                                client_factory=functools.partial(GrpcEngineClient, security=SECURITY))
        attacker = EtcdClient(etcd.endpoint)  # may write anything to etcd, holds no credential
        layout = EtcdLayout(PREFIX)
        engine = make_engine(MODEL)
        engine.instance_id = "real"
        served = await ServedEngine(engine, model="tiny", security=SECURITY).start()
        agent = InstanceAgent(served.server, served.info, EtcdPublisher(EtcdClient(etcd.endpoint), PREFIX, 3.0,
                                                                        security=SECURITY), interval=0.1)
        try:
            await registry.start()
            await registry.wait_synced(10)

            async def plant(iid: str, record: instance_pb2.InstanceInfo, lease: int) -> None:
                await attacker.put(layout.instances + iid, record.SerializeToString(), lease)
                await attacker.put(layout.heartbeats + iid, instance_pb2.Heartbeat(instance_id=iid).SerializeToString(),
                                   lease)

            lease, _ = await attacker.grant(30)
            await plant("unsigned", info("unsigned", fake_address), lease)
            await plant("other", sign_record(OTHER, info("other", fake_address), lease), lease)
            # a record really signed with the credential, for a lease since gone (an earlier registration at the
            # address the attacker holds now), written again under the attacker's lease, and under none
            old, _ = await attacker.grant(30)
            stale = sign_record(SECURITY.keys, info("stale", fake_address), old, now=time.time() - 3600)
            await attacker.revoke(old)
            with pytest.raises(EtcdError):  # etcd refuses writes under a lease that is gone
                await attacker.put(layout.instances + "stale", stale.SerializeToString(), old)
            await plant("stale", stale, lease)
            await attacker.put(layout.instances + "stale0", sign_record(SECURITY.keys, info("stale0", fake_address),
                                                                         old).SerializeToString())
            await agent.start()
            await until(lambda: registry.get("real") is not None and registry.refused_records.get("wrong_lease") == 2,
                        10, "the real engine joining and the replays refused")
            assert registry.refused_records == {"unsigned": 1, "bad_signature": 1, "wrong_lease": 2}
            assert {s.instance_id for s in registry.states()} == {"real"}
            assert metrics.refused.labels("wrong_lease")._value.get() == 2
            state = registry.get("real")
            tokens = [t async for c in await state.client.submit(make_request("r1", PROMPT, max_tokens=5,
                                                                                ignore_eos=True))
                      for t in c.token_ids]
            calls_before_takeover = list(fake.calls)

            # a record signed with the credential that names the fake's address joins: the client challenges the
            # endpoint before sending anything, and the fake cannot answer
            taken, _ = await attacker.grant(30)
            await attacker.put(layout.instances + "taken", sign_record(SECURITY.keys, info("taken", fake_address),
                                                                        taken).SerializeToString(), taken)
            await until(lambda: registry.get("taken") is not None, 10, "the signed record joining")
            client = registry.get("taken").client
            with pytest.raises(ClusterAuthError, match="did not prove"):
                await client.submit(make_request("r2", PROMPT, max_tokens=5))
            assert not (await client.health()).healthy
            await client.abort("r1")
            return tokens, calls_before_takeover, list(fake.calls), client.prove_failures
        finally:
            await agent.stop()
            await registry.close()
            await attacker.close()
            await served.stop()
            await fake_server.stop(0)

    tokens, before, calls, prove_failures = asyncio.run(main())
    assert tokens == expected  # the real, signed engine joined and served
    assert before == []  # refused records: their address never got a single call
    assert [method for method, _, _ in calls] == ["/xllm.engine.v1.EngineService/Prove"] * 3  # submit, health, abort
    assert prove_failures == 3
    for _, metadata, request in calls:  # the challenge carries a fresh nonce, nothing that authenticates
        assert not any(key in (PROOF_KEY, "authorization") for key, _ in metadata)
        assert not any(s in request or any(s in str(v).encode() for _, v in metadata) for s in SECRETS)
        assert len(engine_pb2.ProveRequest.FromString(request).nonce) == 32


def test_a_captured_call_proof_replayed_is_refused():
    async def main():
        served = await ServedEngine(make_engine(MODEL), security=SECURITY).start()
        try:
            proof = make_proof(SECURITY.keys, "/xllm.engine.v1.EngineService/Health")  # as seen on the wire
            async with grpc.aio.insecure_channel(served.info.address) as channel:
                stub = engine_pb2_grpc.EngineServiceStub(channel)
                first = await stub.Health(engine_pb2.HealthRequest(), metadata=((PROOF_KEY, proof),))
                codes = []
                for method in (stub.Health, stub.GetLoad):  # the same proof again, and for another method
                    request = engine_pb2.HealthRequest() if method is stub.Health else engine_pb2.GetLoadRequest()
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await method(request, metadata=((PROOF_KEY, proof),))
                    codes.append(err.value.code())
            return first.healthy, codes
        finally:
            await served.stop()

    healthy, codes = asyncio.run(main())
    assert healthy and codes == [grpc.StatusCode.UNAUTHENTICATED] * 2


def test_the_embedded_registry_takes_only_fresh_signed_records():
    async def main():
        registry = EmbeddedRegistry(client_factory=functools.partial(GrpcEngineClient, security=SECURITY),
                                    credential=SECURITY.keys)
        server, port = await serve_registry(registry, "127.0.0.1", 0, SECURITY)
        address = f"127.0.0.1:{port}"
        codes = []
        try:
            async with open_channel(address, SECURITY) as channel:  # valid call proofs, records not signed right
                stub = registry_pb2_grpc.RegistryServiceStub(channel)
                for record in (info("unsigned", "127.0.0.1:1"), sign_record(OTHER, info("other", "127.0.0.1:1")),
                               sign_record(SECURITY.keys, info("stale", "127.0.0.1:1"), now=time.time() - 3600)):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.Register(registry_pb2.RegisterRequest(info=record, ttl_seconds=3))
                    codes.append(err.value.code())
            publisher = GrpcRegistryPublisher(address, security=SECURITY)  # signs what it registers
            await publisher.register(info("real", "127.0.0.1:2"))
            with pytest.raises(RegistrationRefusedError, match="UNAUTHENTICATED"):  # another credential's proofs
                await GrpcRegistryPublisher(address, security=ClusterSecurity(
                    token=secrets.token_urlsafe(32))).register(info("x", "127.0.0.1:3"))
            await publisher.close()
            return codes, [s.instance_id for s in registry.states()], dict(registry.refused_records)
        finally:
            await server.stop(0)
            await registry.close()

    codes, joined, refused = asyncio.run(main())
    assert codes == [grpc.StatusCode.PERMISSION_DENIED] * 3
    assert joined == ["real"] and refused == {"unsigned": 1, "bad_signature": 1, "stale": 1}
