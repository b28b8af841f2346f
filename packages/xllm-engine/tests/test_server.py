"""The engine's gRPC service over the tiny model: streaming, error statuses, KV events, drain."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from xllm.core import AsyncEngine
from xllm.engine.server import EngineServer
from xllm.engine_api.errors import EngineCrashedError, EngineDeadError, EngineOverloadedError, InvalidRequestError
from xllm.engine_api.wire import (
    ACCEPTED_KEY,
    DRAINING_KEY,
    ERROR_PARAM_KEY,
    HANDED_BACK_KEY,
    OVERLOADED_KEY,
    InstanceUnavailableError,
    RequestFailedError,
    error_from_status,
    status_for,
)
from xllm.kvstore import block_hashes
from xllm.proto.engine.v1 import engine_pb2, engine_pb2_grpc
from xllm.testing.engine import generate, make_engine, make_request
from xllm.testing.processes import until
from xllm.testing.tiny import TinyLM, tiny_tokenizer


def _serve(test, **config):
    """Run ``await test(server, stub)`` against a served tiny engine (paged KV, 16-token blocks)."""
    config.setdefault("kv_cache_backend", "paged")
    config.setdefault("block_size", 16)
    config.setdefault("kv_cache_memory_gib", 0.01)
    engine = make_engine(**config)
    aeng = AsyncEngine(engine)
    server = EngineServer(aeng)
    aeng.start()

    async def main():
        port = await server.start("127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                return await test(server, engine_pb2_grpc.EngineServiceStub(channel))
            finally:
                await server.stop(0)

    try:
        return asyncio.run(main())
    finally:
        aeng.shutdown()
        engine.close()


async def _collect(call) -> list[engine_pb2.GenerateResponse]:
    """Every remaining message (with ``read()``: the iterator and read APIs do not mix)."""
    out = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        out.append(chunk)
    return out


def test_generate_streams_the_engines_tokens():
    prompt = tiny_tokenizer().encode_pieces(list("the cat sat"))
    direct = generate(make_engine(kv_cache_backend="paged", block_size=16, kv_cache_memory_gib=0.01),
                          [make_request("r", prompt, max_tokens=12, ignore_eos=True)])

    async def test(server, stub):
        call = stub.Generate(make_request("r", prompt, max_tokens=12, ignore_eos=True))
        md = dict(await call.initial_metadata())
        chunks = await _collect(call)
        return md, chunks

    md, chunks = _serve(test)
    assert md[ACCEPTED_KEY] == "1"
    assert [t for c in chunks for t in c.token_ids] == direct.tokens["r"]
    assert chunks[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].usage.completion_tokens == 12


def test_rejections_are_statuses_that_map_back_to_engine_errors():
    async def test(server, stub):
        call = stub.Generate(make_request("bad", [1, 2], max_tokens=10_000))
        md = await call.initial_metadata()
        return dict(md), await call.code(), await call.details(), await call.trailing_metadata()

    md, code, details, trailing = _serve(test)
    assert ACCEPTED_KEY not in md
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    err = error_from_status(code, details, tuple(trailing))
    assert isinstance(err, InvalidRequestError) and err.param == "max_tokens"
    assert dict(trailing)[ERROR_PARAM_KEY] == "max_tokens"


def test_error_mapping():
    """Instance faults (another instance may serve it) versus request faults (never replayed)."""
    assert isinstance(error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", ((OVERLOADED_KEY, "1"),)),
                      EngineOverloadedError)
    # gRPC's own RESOURCE_EXHAUSTED (a message over its size limit) is the request's fault: a 400
    too_big = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max")
    assert isinstance(too_big, InvalidRequestError) and too_big.param == "prompt"
    refused = error_from_status(grpc.StatusCode.UNAVAILABLE, "connection refused", instance_id="e1")
    assert isinstance(refused, InstanceUnavailableError) and not refused.crashed and not refused.suspect
    broken = error_from_status(grpc.StatusCode.UNAVAILABLE, "Socket closed", instance_id="e1", mid_stream=True)
    assert broken.crashed and broken.suspect  # it vanished while running the request: it may be the cause
    assert isinstance(error_from_status(grpc.StatusCode.UNKNOWN, "Unexpected error"), RequestFailedError)
    bad = error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "no", ((ERROR_PARAM_KEY, ""),))
    assert isinstance(bad, InvalidRequestError) and bad.param is None
    handed = error_from_status(grpc.StatusCode.UNAVAILABLE, "bye", ((HANDED_BACK_KEY, "1"),), "e1")
    assert isinstance(handed, InstanceUnavailableError) and handed.handed_back and handed.instance_id == "e1"
    assert not handed.suspect
    draining = error_from_status(grpc.StatusCode.UNAVAILABLE, "x", ((DRAINING_KEY, "1"),), "e1")
    assert isinstance(draining, InstanceUnavailableError) and not draining.handed_back
    assert "draining" in str(draining)
    # the server's mapping and the client's are inverses
    for exc in (InvalidRequestError("bad", "top_p"), EngineOverloadedError("full"), EngineDeadError("gone"),
                RequestFailedError("boom")):
        status = status_for(exc)
        back = error_from_status(status.code, status.details, status.trailing)
        assert type(back) is (InstanceUnavailableError if isinstance(exc, EngineDeadError) else type(exc))
        assert str(back).endswith(str(exc)) or str(exc) in str(back)
    for suspect in (True, False):
        back = error_from_status(*_fields(status_for(EngineCrashedError("crashed", suspect))), mid_stream=True)
        assert isinstance(back, InstanceUnavailableError) and back.crashed and back.suspect is suspect
    assert error_from_status(*_fields(status_for(InvalidRequestError("bad", "top_p")))).param == "top_p"


def _fields(status):
    return status.code, status.details, status.trailing


def test_health_load_abort_and_cancel():
    prompt = tiny_tokenizer().encode_pieces(list("abcdefgh"))

    async def test(server, stub):
        health = await stub.Health(engine_pb2.HealthRequest())
        call = stub.Generate(make_request("long", prompt, max_tokens=100, ignore_eos=True))
        first = await call.read()
        load = await stub.GetLoad(engine_pb2.GetLoadRequest())
        aborted = await stub.Abort(engine_pb2.AbortRequest(request_id="long"))
        rest = await _collect(call)
        unknown = await stub.Abort(engine_pb2.AbortRequest(request_id="nope"))
        # a cancelled call aborts its request in the engine
        call2 = stub.Generate(make_request("cancelled", prompt, max_tokens=100, ignore_eos=True))
        await call2.read()
        call2.cancel()
        await until(lambda: not server.engine._engine.has_work() and not server.num_inflight, 10,
                    "the cancelled call's request aborted")
        return health, first, load, aborted, rest, unknown, server.engine._engine.has_work()

    health, first, load, aborted, rest, unknown, busy = _serve(test)
    assert health.healthy and health.status == "ok"
    assert first.token_ids
    assert load.num_running + load.num_waiting == 1 and load.instance_id == "engine-0"
    assert aborted.aborted and not unknown.aborted
    assert rest[-1].finish_reason == engine_pb2.FINISH_REASON_ABORT
    assert not busy


def test_kv_events_and_heartbeat_follow_the_prefix_cache():
    prompt = tiny_tokenizer().encode_pieces(list("the quick brown fox jumps over the lazy dog and more"))
    assert len(prompt) >= 48

    async def test(server, stub):
        before = await stub.GetKVEvents(engine_pb2.GetKVEventsRequest())
        await _collect(stub.Generate(make_request("a", prompt, max_tokens=2, ignore_eos=True)))
        snap = await stub.GetKVEvents(engine_pb2.GetKVEventsRequest())
        delta = await stub.GetKVEvents(engine_pb2.GetKVEventsRequest(since_version=before.version,
                                                                     epoch=before.epoch))
        ack = await stub.GetKVEvents(engine_pb2.GetKVEventsRequest(since_version=snap.version, epoch=snap.epoch))
        await _collect(stub.Generate(make_request("b", prompt, max_tokens=2, ignore_eos=True)))
        hb = server.heartbeat(kv_since=snap.version, seq=3)
        load = await stub.GetLoad(engine_pb2.GetLoadRequest())
        return before, snap, delta, ack, hb, load

    before, snap, delta, ack, hb, load = _serve(test)
    expected = set(block_hashes(prompt, 16))
    assert before.snapshot and not before.stored and before.epoch
    assert snap.snapshot and expected <= set(snap.stored) and snap.block_size == 16
    assert not delta.snapshot and set(delta.stored) == set(snap.stored) and delta.version == snap.version
    assert not ack.snapshot and not ack.stored and not ack.removed
    assert hb.seq == 3 and hb.instance_id == "engine-0" and not hb.draining
    assert hb.counters.prefix_cache_hits >= 16 * (len(prompt) // 16 - 1)  # the 2nd request reused the prefix
    assert hb.counters.finished_requests == 2 and hb.counters.prompt_tokens == 2 * len(prompt)
    assert load.prefill_tokens_per_s > 0


def test_drain_refuses_new_requests_and_hands_back_the_rest():
    """A drain with no grace hands the running request back: its stream ends with UNAVAILABLE +
    handed-back after some of its tokens and before its end; those tokens are the uninterrupted
    run's first ones (nothing lost or repeated before the cut), and a new request is refused."""
    prompt = tiny_tokenizer().encode_pieces(list("abcdefgh"))
    max_tokens = 140

    async def test(server, stub):
        whole = await _collect(stub.Generate(make_request("whole", prompt, max_tokens=max_tokens, ignore_eos=True)))
        call = stub.Generate(make_request("long", prompt, max_tokens=max_tokens, ignore_eos=True))
        first = await call.read()
        handed = await server.drain(timeout=0.0)
        refused = stub.Generate(make_request("late", prompt, max_tokens=2))
        refused_code = await refused.code()
        refused_md = dict(await refused.trailing_metadata())
        chunks, error = await _collect_until_error(call)
        health = await stub.Health(engine_pb2.HealthRequest())
        return (whole, refused_code, refused_md, handed, [first, *chunks], error, dict(await call.trailing_metadata()),
                health)

    whole, refused_code, refused_md, handed, chunks, error, trailing, health = _serve(test, max_model_len=160)
    assert refused_code == grpc.StatusCode.UNAVAILABLE and refused_md[DRAINING_KEY] == "1"
    assert handed == 1
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE and trailing[HANDED_BACK_KEY] == "1"
    assert all(c.finish_reason == engine_pb2.FINISH_REASON_UNSPECIFIED for c in chunks)
    streamed = [t for c in chunks for t in c.token_ids]
    reference = [t for c in whole for t in c.token_ids]
    assert len(reference) == max_tokens
    assert 0 < len(streamed) < max_tokens  # cut mid-way: handed back, not finished
    assert streamed == reference[:len(streamed)]
    assert not health.healthy and health.status == "draining"


async def _collect_until_error(call) -> tuple[list[engine_pb2.GenerateResponse], grpc.aio.AioRpcError | None]:
    """The chunks a call delivered before it failed, and the failure (None if it finished)."""
    chunks = []
    try:
        while (chunk := await call.read()) is not grpc.aio.EOF:
            chunks.append(chunk)
    except grpc.aio.AioRpcError as exc:
        return chunks, exc
    return chunks, None


@pytest.mark.parametrize("timeout", [5.0])
def test_drain_waits_for_running_requests(timeout):
    prompt = tiny_tokenizer().encode_pieces(list("abcd"))

    async def test(server, stub):
        call = stub.Generate(make_request("short", prompt, max_tokens=20, ignore_eos=True))
        await call.read()
        handed = await server.drain(timeout=timeout)
        chunks = await _collect(call)
        return handed, chunks, await call.code()

    handed, chunks, code = _serve(test)
    assert handed == 0 and code == grpc.StatusCode.OK
    assert chunks[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH


class PoisonedLM(TinyLM):
    """Crashes (like a kernel bug would) on any forward that contains ``POISON``, once ``release``
    is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def forward(self, input_ids, positions, ctx):
        if bool((input_ids == POISON).any()):
            self.release.wait(30)
            raise RuntimeError("kernel fault")
        return super().forward(input_ids, positions, ctx)


POISON = 7


def test_a_crashing_step_marks_its_requests_suspect_and_the_rest_bystanders():
    """The engine loop dies in a step: the requests of that step are reported as suspects (the
    gateway fails one that is a suspect twice), the others as bystanders (resumed freely); health
    and the heartbeat then say the engine is dead."""
    model = PoisonedLM()
    engine = make_engine(model, max_num_seqs=1)

    async def main():
        aeng = AsyncEngine(engine)
        server = EngineServer(aeng)
        aeng.start()
        port = await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        try:
            poisoned = stub.Generate(make_request("poison", [3, POISON, 4], max_tokens=4))
            assert dict(await poisoned.initial_metadata()).get(ACCEPTED_KEY) == "1"
            waiting = stub.Generate(make_request("waiting", [3, 4], max_tokens=4))  # queued behind it (1 seq)
            assert dict(await waiting.initial_metadata()).get(ACCEPTED_KEY) == "1"
            model.release.set()
            errors = {}
            for rid, call in (("poison", poisoned), ("waiting", waiting)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
                errors[rid] = error_from_status(err.value.code(), err.value.details(),
                                                err.value.trailing_metadata(), "e", mid_stream=True)
            health = await stub.Health(engine_pb2.HealthRequest())
            return errors, health, server.heartbeat(None)
        finally:
            await channel.close()
            await server.stop(0)
            aeng.shutdown()

    errors, health, beat = asyncio.run(main())
    assert errors["poison"].crashed and errors["poison"].suspect
    assert errors["waiting"].crashed and not errors["waiting"].suspect
    assert not health.healthy and "crashed" in health.status
    assert "crashed" in beat.unhealthy_reason
