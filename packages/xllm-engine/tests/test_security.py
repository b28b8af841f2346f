"""The internal services' security (:mod:`xllm.engine_api.security`) on a served tiny engine: the cluster
token on every kind of call (refused calls never reach the engine, and read as a configuration error
on the client side, not as a dead instance), KV hand-offs between token-protected engines, TLS with
server verification, the bind policy applied by the server and ``xllm engine``. The policy, the
flags and the token check alone: packages/xllm-engine-api/tests/test_security.py."""

from __future__ import annotations

import argparse
import asyncio
import secrets
from pathlib import Path

import grpc
import pytest

from xllm.core import AsyncEngine
from xllm.engine.handoff.base import HandoffOptions, TransferError
from xllm.engine.handoff.grpc import TransferChannels
from xllm.engine.instance import run
from xllm.engine.server import EngineServer
from xllm.engine_api import flags
from xllm.engine_api.client import GrpcEngineClient
from xllm.engine_api.security import (
    NO_SECURITY,
    ClusterSecurity,
    SecurityConfigError,
)
from xllm.engine_api.wire import ClusterAuthError, InstanceUnavailableError
from xllm.proto.engine.v1 import engine_pb2, engine_pb2_grpc
from xllm.testing.engine import generate, make_engine, make_request
from xllm.testing.served import ServedEngine, pd_generate
from xllm.testing.tiny import TinyLM
from xllm.testing.tls import have_openssl, self_signed

MODEL = TinyLM()
TOKEN = "t" + secrets.token_urlsafe(24)  # never starting with "-" (argparse would read an option)
OTHER = "o" + secrets.token_urlsafe(24)
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
GREEDY = dict(max_tokens=6, ignore_eos=True)

needs_openssl = pytest.mark.skipif(not have_openssl(), reason="the openssl command makes the test certificates")


async def served(name: str, security: ClusterSecurity, **handoff) -> ServedEngine:
    engine = make_engine(MODEL)
    engine.instance_id = name
    return await ServedEngine(engine, handoff=HandoffOptions(**handoff), security=security).start()


async def tokens_of(client: GrpcEngineClient, rid: str) -> list[int]:
    return [t async for chunk in await client.submit(make_request(rid, PROMPT, **GREEDY)) for t in chunk.token_ids]


def oracle() -> list[int]:
    return generate(make_engine(MODEL), [make_request("ref", PROMPT, **GREEDY)]).tokens["ref"]


def test_the_token_is_required_on_every_kind_of_call_and_refusals_never_reach_the_engine():
    expected = oracle()

    async def main():
        e = await served("e", ClusterSecurity(token=TOKEN))
        try:
            assert await tokens_of(e.client, "ok") == expected  # the right token: served
            for security in (NO_SECURITY, ClusterSecurity(token=OTHER)):
                client = GrpcEngineClient(e.info, security=security)
                try:
                    with pytest.raises(ClusterAuthError, match="--cluster-token") as refused:
                        await client.submit(make_request("no", PROMPT, **GREEDY))
                    # a configuration error: the gateway must not take it for a dead instance and move on
                    assert not isinstance(refused.value, InstanceUnavailableError)
                    assert refused.value.instance_id == "e"
                    with pytest.raises(ClusterAuthError):  # nor can it continue a stream (Reattach)
                        await client.reattach("ok", 0)
                    health = await client.health()  # no token: refused; another one: the engine cannot prove
                    assert not health.healthy and ("UNAUTHENTICATED" in health.status if security is NO_SECURITY
                                                   else "did not prove" in health.status)
                finally:
                    await client.close()
            # every call kind, on a raw channel without the token: unary, server-streaming, client-streaming
            async with grpc.aio.insecure_channel(e.info.address) as channel:
                stub = engine_pb2_grpc.EngineServiceStub(channel)
                calls = [stub.Health(engine_pb2.HealthRequest()), stub.GetLoad(engine_pb2.GetLoadRequest()),
                         stub.Abort(engine_pb2.AbortRequest(request_id="ok"))]
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                for stream in (stub.Generate(make_request("raw", PROMPT, **GREEDY)),
                               stub.Reattach(engine_pb2.ReattachRequest(request_id="ok"))):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stream.read()
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(TransferError, match="UNAUTHENTICATED"):  # TransferKV with a wrong token
                channels = TransferChannels(ClusterSecurity(token=OTHER))
                try:
                    await channels.transfer(e.info.address, _no_messages(), timeout=5)
                finally:
                    await channels.close()
            return e.server.counters()
        finally:
            await e.stop()

    counters = asyncio.run(main())
    assert counters.finished_requests == 1 and counters.prompt_tokens == len(PROMPT)  # only the admitted request


async def _no_messages():
    return
    yield  # an empty client stream


def test_token_protected_engines_hand_off_kv_over_grpc():
    """``TransferKV`` between engines carries the token (the server passes its security to the sender)."""
    mixed = generate(make_engine(MODEL), [make_request("r", PROMPT, **GREEDY)])

    async def main():
        security = ClusterSecurity(token=TOKEN)
        prefill, decode = await served("p", security, transport="grpc"), await served("d", security, transport="grpc")
        try:
            got, _, stats = await pd_generate(prefill, decode, "r", PROMPT, **GREEDY)
            return got, stats
        finally:
            await prefill.stop()
            await decode.stop()

    got, stats = asyncio.run(main())
    assert got.tokens["r"] == mixed.tokens["r"]
    assert stats is not None and not stats.recomputed and stats.transfer_bytes > 0


@needs_openssl
def test_tls_round_trip_verifies_the_server(tmp_path):
    """One certificate for the cluster, naming ``xllm-cluster`` only: clients trusting its CA and
    expecting that name get through; plaintext, another CA, or the unnamed dialled host do not."""
    cert = self_signed(tmp_path / "cluster", "xllm-cluster", hosts=())
    stranger = self_signed(tmp_path / "other", "xllm-cluster", hosts=())
    expected = oracle()

    def tls(ca: Path, name: str | None = "xllm-cluster") -> ClusterSecurity:
        return ClusterSecurity(token=TOKEN, tls_cert=str(cert.cert), tls_key=str(cert.key), tls_ca=str(ca),
                               tls_server_name=name)

    async def main():
        e = await served("t", tls(cert.cert))
        try:
            assert await tokens_of(e.client, "ok") == expected
            for security in (ClusterSecurity(token=TOKEN), tls(stranger.cert), tls(cert.cert, name=None)):
                client = GrpcEngineClient(e.info, rpc_timeout=5, security=security)
                try:
                    with pytest.raises(InstanceUnavailableError):  # the handshake fails: nothing was sent
                        await client.submit(make_request("no", PROMPT, **GREEDY))
                finally:
                    await client.close()
            return e.server.counters().finished_requests
        finally:
            await e.stop()

    assert asyncio.run(main()) == 1


def test_internal_services_bind_non_loopback_only_with_a_token(capsys):
    """The engine server and ``xllm engine`` apply the bind policy (the policy itself:
    packages/xllm-engine-api/tests/test_security.py)."""
    engine = make_engine(MODEL)
    server = EngineServer(AsyncEngine(engine))

    async def main():
        with pytest.raises(SecurityConfigError, match="refusing to serve the engine service"):
            await server.start("0.0.0.0", 0)
        assert server.port is None  # nothing was bound

    asyncio.run(main())
    engine.close()
    # `xllm engine --host 0.0.0.0` without a token stops before loading the model, naming the flag
    parser = argparse.ArgumentParser()
    flags.add_engine_process_arguments(parser)
    args = parser.parse_args(["--host", "0.0.0.0", "--model", "/nonexistent/model"])
    assert run(args, "xllm engine") == 2
    err = capsys.readouterr().err
    assert err.startswith("xllm engine: error: refusing to serve") and "--cluster-token" in err
