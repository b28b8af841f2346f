"""The gRPC client of the engine service against a real EngineServer (tiny model): each engine error
and each way an instance goes away reaches the caller as the error the gateway acts on."""

from __future__ import annotations

import asyncio

import pytest

from xllm.core import AsyncEngine
from xllm.engine.server import EngineServer
from xllm.engine_api.client import GrpcEngineClient
from xllm.engine_api.errors import EngineOverloadedError, InvalidRequestError
from xllm.engine_api.wire import InstanceUnavailableError
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.engine import make_engine, make_request


async def _drain(stream) -> list[engine_pb2.GenerateResponse]:
    return [chunk async for chunk in stream]


def test_grpc_client_maps_statuses_to_engine_errors():
    async def run():
        engine = make_engine(kv_backend="paged", kv_cache_memory_gib=0.01, max_waiting_requests=1, max_num_seqs=1)
        aeng = AsyncEngine(engine)
        server = EngineServer(aeng)
        aeng.start()
        port = await server.start("127.0.0.1", 0)
        info = instance_pb2.InstanceInfo(instance_id=engine.instance_id, address=f"127.0.0.1:{port}")
        client = GrpcEngineClient(info)
        prompt = [3, 4, 5, 6]
        try:
            chunks = await _drain(await client.submit(make_request("ok", prompt, max_tokens=4, ignore_eos=True)))
            assert sum(len(c.token_ids) for c in chunks) == 4
            assert chunks[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
            with pytest.raises(InvalidRequestError) as bad:
                await client.submit(make_request("bad", prompt, max_tokens=10_000))
            assert bad.value.param == "max_tokens"
            assert (await client.health()).healthy
            assert (await client.load()).instance_id == engine.instance_id == "engine-0"
            assert (await client.kv_events(0, 0, snapshot=True)).epoch  # the server publishes its prefix cache
            # a full queue is "overloaded" (HTTP 503), not a reason to try another instance
            streams = []
            with pytest.raises(EngineOverloadedError):
                for i in range(10):
                    streams.append(await client.submit(make_request(f"q{i}", prompt, max_tokens=30, ignore_eos=True)))
            assert streams
            for s in streams:
                await _drain(s)
            # a stream the instance hands back while shutting down is "unavailable": resumable elsewhere
            long = await client.submit(make_request("long", prompt, max_tokens=120, ignore_eos=True))
            it = aiter(long)
            await anext(it)
            await server.drain(0)
            with pytest.raises(InstanceUnavailableError) as gone:
                async for _ in it:
                    pass
            assert gone.value.handed_back and gone.value.instance_id == "engine-0"
            with pytest.raises(InstanceUnavailableError, match="draining"):  # draining: refuses new work
                await client.submit(make_request("late", prompt, max_tokens=2))
            assert not (await client.health()).healthy
        finally:
            await client.close()
            await server.stop(0)
            aeng.shutdown()
            engine.close()
        # nothing listens any more: unreachable is "unavailable" too
        gone_client = GrpcEngineClient(info)
        with pytest.raises(InstanceUnavailableError):
            await gone_client.submit(make_request("x", [1, 2], max_tokens=2))
        with pytest.raises(InstanceUnavailableError):
            await gone_client.load()
        assert not (await gone_client.health()).healthy
        await gone_client.close()

    asyncio.run(run())


def test_a_client_needs_an_address():
    with pytest.raises(ValueError, match="no address"):
        GrpcEngineClient(instance_pb2.InstanceInfo(instance_id="a"))
