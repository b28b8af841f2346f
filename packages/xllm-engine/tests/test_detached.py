"""Requests that outlive their Generate call (xllm.engine.detached): a call broken without an Abort
leaves its request running for the grace period, ``Reattach`` continues it from a token offset exactly
as the one call would have streamed it (greedy and seeded), an explicit Abort still aborts at once, and
a request nobody reattaches is aborted when its grace period ends."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from xllm.core import AsyncEngine
from xllm.engine.detached import start_index
from xllm.engine.server import EngineServer
from xllm.engine_api.client import GrpcEngineClient
from xllm.proto.engine.v1 import engine_pb2, engine_pb2_grpc
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.engine import make_engine, make_request
from xllm.testing.processes import until
from xllm.testing.tiny import tiny_tokenizer

PROMPT = tiny_tokenizer().encode_pieces(list("the cat sat on"))
SAMPLING = {"greedy": {}, "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 1234}}


class Hold:
    """Holds the engine thread after its next step while cleared (a request then cannot finish)."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.go.set()

    def on_step(self, stats) -> None:
        assert self.go.wait(30), "engine held for 30 s"


def _serve(test, grace_s: float = 30.0):
    """Run ``await test(server, stub, client, hold)`` against a served tiny engine."""
    engine = make_engine(kv_cache_backend="paged", block_size=16, kv_cache_memory_gib=0.01)
    aeng = AsyncEngine(engine)
    server = EngineServer(aeng, detached_grace_s=grace_s)
    hold = Hold()
    aeng.add_observer(hold)
    aeng.start()

    async def main():
        port = await server.start("127.0.0.1", 0)
        client = GrpcEngineClient(instance_pb2.InstanceInfo(instance_id="engine-0", address=f"127.0.0.1:{port}"))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                return await test(server, engine_pb2_grpc.EngineServiceStub(channel), client, hold)
            finally:
                hold.go.set()
                await client.close()
                await server.stop(0)

    try:
        return asyncio.run(main())
    finally:
        aeng.shutdown()
        engine.close()


async def _read(call, n: int | None = None) -> list[engine_pb2.GenerateResponse]:
    """``n`` messages of ``call`` (None: all)."""
    out = []
    while n is None or len(out) < n:
        chunk = await call.read()
        if chunk is grpc.aio.EOF:
            break
        out.append(chunk)
    return out


async def _break(server, hold: Hold, call, rid: str) -> None:
    """Break ``call`` as a dying gateway does (no Abort) with the engine held, so the request is
    still running when it detaches; then let the engine go on."""
    hold.go.clear()
    call.cancel()
    await until(lambda: rid in server.detached, 10, f"{rid} detached")
    hold.go.set()


def _tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


@pytest.mark.parametrize("sampling", SAMPLING)
def test_a_broken_call_detaches_and_reattach_continues_it_exactly(sampling):
    params = dict(max_tokens=40, ignore_eos=True, **SAMPLING[sampling])

    async def test(server, stub, client, hold):
        reference = await _read(stub.Generate(make_request("ref", PROMPT, **params)))
        call = stub.Generate(make_request("r", PROMPT, **params))
        first = await _read(call, 3)
        await _break(server, hold, call, "r")
        # reattached, broken again (a second gateway dying): detached once more
        again = stub.Reattach(engine_pb2.ReattachRequest(request_id="r", from_token=len(_tokens(first))))
        second = await _read(again, 2)
        await _break(server, hold, again, "r")
        rest = [c async for c in await client.reattach("r", len(_tokens(first + second)))]
        await until(lambda: not server.engine._engine.has_work(), 10, "the engine idle")
        return reference, first + second + rest, "r" in server.detached

    reference, resumed, kept = _serve(test)
    assert _tokens(resumed) == _tokens(reference) and len(_tokens(reference)) == 40
    assert "".join(c.text for c in resumed) == "".join(c.text for c in reference)
    assert resumed[-1].finish_reason == reference[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert resumed[-1].usage.completion_tokens == 40
    assert not kept  # streamed to its end: forgotten


def test_reattach_refusals_and_explicit_aborts():
    async def test(server, stub, client, hold):
        refused = {}
        for rid, offset in (("nope", 0), ("r", 1_000)):
            with pytest.raises(LookupError) as exc:
                await client.reattach(rid, offset)
            refused[rid] = str(exc.value)
        call = stub.Generate(make_request("r", PROMPT, max_tokens=120, ignore_eos=True))
        got = await _read(call, 2)
        await _break(server, hold, call, "r")
        hold.go.clear()  # keeps the request running while it is refused
        with pytest.raises(LookupError) as exc:
            await client.reattach("r", len(_tokens(got)) + 1_000)
        refused["boundary"] = str(exc.value)
        attached = stub.Reattach(engine_pb2.ReattachRequest(request_id="r", from_token=0))
        await attached.initial_metadata()
        with pytest.raises(LookupError) as exc:
            await client.reattach("r", 0)
        refused["attached"] = str(exc.value)
        hold.go.set()
        replay = await _read(attached, len(got))  # from token 0: the chunks the broken call had streamed
        aborted = await stub.Abort(engine_pb2.AbortRequest(request_id="r"))  # explicit: at once
        tail = await _read(attached)
        await until(lambda: not server.engine._engine.has_work(), 10, "the aborted request gone")
        # a gateway leaving a stream early (its client went away) aborts it explicitly: nothing detaches
        stream = await client.submit(make_request("left", PROMPT, max_tokens=120, ignore_eos=True))
        async for _ in stream:
            break
        await until(lambda: not server.engine._engine.has_work() and not server.num_inflight, 10, "left aborted")
        return refused, got, replay, aborted, tail, len(server.detached)

    refused, got, replay, aborted, tail, detached = _serve(test)
    assert "no detached request 'nope'" in refused["nope"] and "no detached request 'r'" in refused["r"]
    assert "not a chunk boundary" in refused["boundary"] and "attached to a call" in refused["attached"]
    assert _tokens(replay) == _tokens(got) and [c.text for c in replay] == [c.text for c in got]
    assert aborted.aborted and tail[-1].finish_reason == engine_pb2.FINISH_REASON_ABORT
    assert detached == 0


def test_a_request_not_reattached_within_the_grace_period_is_aborted():
    async def test(server, stub, client, hold):
        server.detached.grace_s = 0.05
        call = stub.Generate(make_request("r", PROMPT, max_tokens=120, ignore_eos=True))
        await _read(call, 2)
        hold.go.clear()  # the request cannot finish before its grace period ends
        call.cancel()
        await until(lambda: server.detached.expired == 1, 10, "the grace period over")
        hold.go.set()
        await until(lambda: not server.engine._engine.has_work(), 10, "the request aborted")
        load = server.load_report()
        return load, len(server.detached)

    load, detached = _serve(test)
    assert load.num_running == load.num_waiting == 0 and detached == 0


def test_start_index_is_a_chunk_boundary():
    chunks = [engine_pb2.GenerateResponse(token_ids=t) for t in ([1, 2], [3], [4, 5, 6])]
    assert [start_index(chunks, n) for n in range(7)] == [0, None, 1, 2, None, None, 3]


def test_calls_broken_by_the_server_stopping_are_aborted_not_detached():
    async def test(server, stub, client, hold):
        call = stub.Generate(make_request("r", PROMPT, max_tokens=120, ignore_eos=True))
        await _read(call, 2)
        await server.stop(0)
        await until(lambda: not server.engine._engine.has_work(), 10, "the request aborted")
        return len(server.detached)

    assert _serve(test) == 0
