"""Shared serving helpers: stream merging, result collection, dispatch and usage accounting."""

from __future__ import annotations

import asyncio
import json

import pytest

from xllm.engine_api.errors import InvalidRequestError
from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.openai.errors import APIError
from xllm.gateway.openai.serving import Choice, collect, merge_streams, sse, usage_dict
from xllm.gateway.registry import EmbeddedRegistry
from xllm.proto.engine.v1 import engine_pb2


class Stream:
    """An async iterable of chunks that records whether it was left early."""

    def __init__(self, rid: str, n: int, fail_at: int | None = None, delay: float = 0.0) -> None:
        self.rid, self.n, self.fail_at, self.delay = rid, n, fail_at, delay
        self.closed_early = False
        self.ended = asyncio.Event()  # set when the generator has run its finally block

    async def __aiter__(self):
        done = False
        try:
            for k in range(self.n):
                await asyncio.sleep(self.delay)
                if k == self.fail_at:
                    done = True
                    raise InvalidRequestError("engine rejected it", "prompt")
                last = k == self.n - 1
                chunk = engine_pb2.GenerateResponse(request_id=self.rid, token_ids=[k], text=f"{self.rid}:{k} ")
                if last:
                    done = True
                    chunk.finish_reason = engine_pb2.FINISH_REASON_STOP
                    chunk.usage.completion_tokens = self.n
                    chunk.usage.cached_prompt_tokens = 1
                yield chunk
        finally:
            if not done:
                self.closed_early = True
            self.ended.set()


class Disconnectable:
    """The part of a Starlette Request that ``collect`` uses."""

    def __init__(self, after_polls: int | None = None) -> None:
        self.after_polls, self.polls = after_polls, 0

    async def is_disconnected(self) -> bool:
        self.polls += 1
        return self.after_polls is not None and self.polls > self.after_polls


def test_usage_dict():
    assert usage_dict(5, 7, 2) == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                                   "prompt_tokens_details": {"cached_tokens": 2}}
    assert usage_dict(1, 0)["prompt_tokens_details"] == {"cached_tokens": 0}


def test_choice_accumulates_until_final_chunk():
    c = Choice(0, prompt_tokens=3)
    c.add(engine_pb2.GenerateResponse(token_ids=[1], text="a"))
    assert c.finish_reason is None
    final = engine_pb2.GenerateResponse(token_ids=[2, 3], text="bc", finish_reason=engine_pb2.FINISH_REASON_LENGTH)
    final.usage.completion_tokens = 3
    c.add(final)
    assert (c.text, c.token_ids, c.finish_reason, c.completion_tokens) == ("abc", [1, 2, 3], "length", 3)


def test_merge_single_stream_in_order():
    async def run():
        return [(i, ch.text) async for i, ch in merge_streams([Stream("a", 3)])]

    assert asyncio.run(run()) == [(0, "a:0 "), (0, "a:1 "), (0, "a:2 ")]


def test_merge_several_streams_keeps_each_order():
    async def run():
        return [(i, ch.token_ids[0]) async for i, ch in merge_streams([Stream("a", 4), Stream("b", 2),
                                                                        Stream("c", 3)])]

    out = asyncio.run(run())
    for i, n in enumerate((4, 2, 3)):
        assert [tok for j, tok in out if j == i] == list(range(n))


@pytest.mark.parametrize("n_streams", [1, 3])
def test_leaving_the_merge_closes_every_stream(n_streams):
    streams = [Stream(f"s{i}", 100, delay=0.001) for i in range(n_streams)]

    async def run():
        agen = merge_streams(streams)
        async for _ in agen:
            break
        await agen.aclose()
        await asyncio.wait_for(asyncio.gather(*(s.ended.wait() for s in streams)), 10)  # the pumps unwound

    asyncio.run(run())
    assert all(s.closed_early for s in streams)


def test_merge_forwards_stream_errors():
    async def run():
        return [x async for x in merge_streams([Stream("a", 5), Stream("b", 5, fail_at=2)])]

    with pytest.raises(InvalidRequestError, match="engine rejected"):
        asyncio.run(run())


def test_collect_runs_all_choices():
    async def run():
        return await collect([Stream("a", 2), Stream("b", 3)], [4, 4], Disconnectable())

    a, b = asyncio.run(run())
    assert (a.index, a.text, a.completion_tokens, a.finish_reason, a.cached_tokens) == (0, "a:0 a:1 ", 2, "stop", 1)
    assert (b.index, b.text, b.completion_tokens, b.prompt_tokens) == (1, "b:0 b:1 b:2 ", 3, 4)


def test_collect_aborts_when_the_client_disconnects():
    streams = [Stream("a", 10_000, delay=0.01), Stream("b", 10_000, delay=0.01)]
    request = Disconnectable(after_polls=1)

    async def run():
        try:
            await collect(streams, [1, 1], request)
        finally:
            await asyncio.wait_for(asyncio.gather(*(s.ended.wait() for s in streams)), 10)

    with pytest.raises(APIError) as info:
        asyncio.run(run())
    assert info.value.status == 499
    assert all(s.closed_early for s in streams)


class Client:
    def __init__(self, fail_on: int | None = None) -> None:
        from xllm.proto.registry.v1 import instance_pb2

        self.info = instance_pb2.InstanceInfo(instance_id="c0", model=instance_pb2.ModelInfo(served_name="m"))
        self.fail_on = fail_on
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.all_aborted = asyncio.Event()  # every submitted request was aborted

    async def submit(self, req, trace=None):
        if len(self.submitted) == self.fail_on:
            raise InvalidRequestError("too long", "prompt")
        self.submitted.append(req.request_id)
        return Stream(req.request_id, 1)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if sorted(self.aborted) == sorted(self.submitted):
            self.all_aborted.set()


def _dispatcher(client: Client | None) -> Dispatcher:
    reg = EmbeddedRegistry()
    if client is not None:
        reg.register(client)
    return Dispatcher(reg, "m")


def test_resolve_model():
    d = _dispatcher(Client())
    assert d.resolve_model(None) == "m"
    assert d.resolve_model("") == "m"
    assert d.resolve_model("m") == "m"
    with pytest.raises(APIError) as info:
        d.resolve_model("other")
    assert (info.value.status, info.value.code, info.value.param) == (404, "model_not_found", "model")


def test_submit_all_aborts_the_submitted_ones_on_failure():
    client = Client(fail_on=2)
    d = _dispatcher(client)
    reqs = [engine_pb2.GenerateRequest(request_id=f"r{i}") for i in range(4)]

    async def run():
        try:
            await d.submit_all("m", reqs)
        finally:
            await asyncio.wait_for(client.all_aborted.wait(), 10)  # the aborts run in the background

    with pytest.raises(APIError) as info:
        asyncio.run(run())
    assert (info.value.status, info.value.param) == (400, "prompt")
    assert client.submitted == ["r0", "r1"]
    assert sorted(client.aborted) == ["r0", "r1"]


def test_submit_all_without_instances_is_503():
    d = Dispatcher(EmbeddedRegistry(), "m")
    with pytest.raises(APIError) as info:
        asyncio.run(d.submit_all("m", [engine_pb2.GenerateRequest(request_id="r")]))
    assert info.value.status == 503


def test_submit_all_returns_one_stream_per_request():
    client = Client()

    async def run():
        return await _dispatcher(client).submit_all(
            "m", [engine_pb2.GenerateRequest(request_id=f"r{i}") for i in range(3)])

    picked, streams = asyncio.run(run())
    assert picked is client
    assert [s.request_id for s in streams] == ["r0", "r1", "r2"]


def test_collect_maps_engine_errors_to_api_errors():
    async def run():
        await collect([Stream("a", 5, fail_at=1)], [1], Disconnectable())

    with pytest.raises(APIError) as info:
        asyncio.run(run())
    assert (info.value.status, info.value.param, info.value.message) == (400, "prompt", "engine rejected it")


def test_an_event_is_one_line_for_clients_that_split_like_splitlines():
    """httpx's aiter_lines and requests' iter_lines split at U+2028, U+0085, \\x1c...; JSON leaves those
    raw, so the server escapes them (a model's text can contain any of them)."""
    text = "a\u2028b\u2029c\x85d\x1ce\x1df\x1eg\x0bh\x0ci\nj"
    event = sse(json.dumps({"text": text}, ensure_ascii=False))
    lines = event.splitlines()
    assert lines[0].startswith("data: ") and lines[1:] == [""]
    assert json.loads(lines[0][6:])["text"] == text
