"""A client closed under an in-flight call (the registry drops an instance whose lease expired while
``/health`` or ``/metrics`` was asking it) reads as an unavailable instance, not as the caller's
cancellation (which became a 500 on the gateway's ``/health``); the caller's own cancellation still
propagates."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from xllm.engine_api.client import GrpcEngineClient
from xllm.engine_api.wire import InstanceUnavailableError
from xllm.proto.engine.v1 import engine_pb2, engine_pb2_grpc
from xllm.proto.registry.v1 import instance_pb2


class _Stalling(engine_pb2_grpc.EngineServiceServicer):
    """Answers ``Health`` and ``GetLoad`` only once ``release`` is set."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def Health(self, request, context):
        self.entered.set()
        await self.release.wait()
        return engine_pb2.HealthResponse(healthy=True)

    async def GetLoad(self, request, context):
        self.entered.set()
        await self.release.wait()
        return instance_pb2.LoadReport()


async def _with_server(body):
    servicer = _Stalling()
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcEngineClient(instance_pb2.InstanceInfo(instance_id="e0", address=f"127.0.0.1:{port}"))
    try:
        await body(client, servicer)
    finally:
        servicer.release.set()
        await client.close()
        await server.stop(0)


def test_health_of_a_client_closed_mid_call_is_unhealthy_not_cancelled():
    async def body(client, servicer):
        call = asyncio.create_task(client.health())
        await servicer.entered.wait()
        await client.close()
        report = await call
        assert not report.healthy and "closed" in report.status

    asyncio.run(_with_server(body))


def test_load_of_a_client_closed_mid_call_raises_unavailable():
    async def body(client, servicer):
        call = asyncio.create_task(client.load())
        await servicer.entered.wait()
        await client.close()
        with pytest.raises(InstanceUnavailableError, match="closed"):
            await call

    asyncio.run(_with_server(body))


def test_the_callers_own_cancellation_still_propagates():
    async def body(client, servicer):
        call = asyncio.create_task(client.health())
        await servicer.entered.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(_with_server(body))
