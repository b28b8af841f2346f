"""Streams that survive their gateway: two gateways (uvicorn on this loop) over one engine server (tiny
model, gRPC, ``--detached-grace-s``). A stream starts through gateway A, which then dies as the engine sees
it (its call breaks without an ``Abort``: the engine detaches the request); the client reconnects through
gateway B with the stream id and ``Last-Event-ID`` (``GET /v1/streams/{id}``). The oracle is an
uninterrupted run: the concatenated text is the same, every character once, with the same finish reason
and usage (greedy and seeded). Forged and foreign ids are refused; a stream not resumed within the grace
period is a clean 404 naming it. (A SIGKILLed gateway process over etcd:
integration_tests/reliability/test_control_plane.py.)"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import uvicorn

from xllm.engine_api.client import GrpcEngineClient
from xllm.gateway.app import GatewayState, create_app
from xllm.gateway.metrics import EngineMetrics
from xllm.gateway.registry import EmbeddedRegistry
from xllm.testing.engine import make_engine
from xllm.testing.processes import until
from xllm.testing.served import ServedEngine
from xllm.testing.tiny import TinyLM, tiny_tokenizer

MODEL = "tiny"
KEY = b"k" * 32  # both gateways' stream key (the cluster's, derived from its token)
PROMPT = tiny_tokenizer().encode_pieces(list("the cat sat on the mat and the dog sat on the cat"))  # token ids
TIMEOUT = 30.0
SSE = {"accept": "text/event-stream"}  # an SSE client: its events carry ids (Last-Event-ID)


class Hold:
    """Holds the engine thread, once armed (:meth:`arm`), from its second step on until :meth:`release` (a
    request then cannot finish, and the first step's output reaches its stream)."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.go.set()
        self.steps = -1  # steps since armed (-1: not armed)

    def arm(self) -> None:
        self.steps = 0
        self.go.clear()

    def release(self) -> None:
        self.steps = -1
        self.go.set()

    def on_step(self, stats) -> None:
        if self.steps >= 0:
            self.steps += 1
            if self.steps >= 2:
                assert self.go.wait(TIMEOUT), "engine held too long"


class Gateway:
    """One gateway app with its own registry and engine client (its own channel), on this loop."""

    def __init__(self, node: ServedEngine, tokenizer) -> None:
        self.client = GrpcEngineClient(node.info)
        registry = EmbeddedRegistry()
        registry.register(self.client)
        state = GatewayState(registry=registry, tokenizer=tokenizer, metrics=EngineMetrics(),
                             default_model=MODEL, max_model_len=node.engine.max_model_len, stream_key=KEY)
        self.server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="warning"))
        self.task: asyncio.Task | None = None

    async def start(self) -> str:
        self.task = asyncio.ensure_future(self.server.serve())
        await until(lambda: self.server.started, TIMEOUT, "the gateway started")
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def die(self) -> None:
        """From now on this gateway's calls break as a dead process's do: cancelled, with no ``Abort``."""
        async def no_abort(request_id: str) -> None:
            return None
        self.client.abort = no_abort

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task
        await self.client.close()


def _events(lines: list[str]) -> list[tuple[str | None, str]]:
    out, eid = [], None
    for line in lines:
        if line.startswith("id: "):
            eid = line[4:]
        elif line.startswith("data: "):
            out.append((eid, line[6:]))
            eid = None
    return out


def _text(events, n: int = 1) -> list[str]:
    """Each of ``n`` choices' text, from the events' chunks."""
    texts = dict.fromkeys(range(n), "")
    for _, data in events:
        if data != "[DONE]":
            for c in json.loads(data)["choices"]:
                texts[c["index"]] += c.get("text", c.get("delta", {}).get("content", ""))
    return [texts[i] for i in range(n)]


def _final(events) -> tuple[list[str | None], dict | None]:
    """Each choice's finish reason and the usage of the last chunk."""
    chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
    finish = {c["index"]: c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]}
    return [finish[i] for i in sorted(finish)], chunks[-1].get("usage")


def _run(test, tokenizer, grace_s: float = 30.0):
    """Run ``await test(node, hold, gateway a, a's url, b's url, http client)`` (``tokenizer``: the gateways',
    any whose vocabulary covers the tiny model's: the prompts are token ids)."""
    node = ServedEngine(make_engine(TinyLM()), model=MODEL)
    node.server.detached.grace_s = grace_s
    hold = Hold()
    node.aeng.add_observer(hold)

    async def main():
        await node.start()
        a, b = Gateway(node, tokenizer), Gateway(node, tokenizer)
        try:
            async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                return await test(node, hold, a, await a.start(), await b.start(), http)
        finally:
            hold.release()
            await a.stop()
            await b.stop()
            await node.stop()

    return asyncio.run(main())


async def _break_off(node, hold: Hold, gateway: Gateway, http, url: str, body: dict):
    """Stream ``body`` through ``gateway`` until an event with output, then kill the gateway (as the engine
    sees it) with the engine held: the events the client got, the stream id and its ``Last-Event-ID``."""
    lines = []
    hold.arm()
    async with http.stream("POST", url + "/v1/completions", json=body, headers=SSE) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            lines.append(line)
            if line.startswith("data: ") and any(_text(_events(lines[-2:]), body.get("n", 1))):
                break
        gateway.die()
    events = _events(lines)
    stream_id = json.loads(events[0][1])["id"]
    n = body.get("n", 1)
    await until(lambda: all(f"{stream_id}-{k}" in node.server.detached for k in range(n)), TIMEOUT,
                "the requests detached")
    return events, stream_id, events[-1][0]


BODIES = {
    "greedy": {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0.0,
               "stream": True, "stream_options": {"include_usage": True}},
    "seeded-n2": {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0.9,
                  "seed": 7, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
}


@pytest.mark.parametrize("case", BODIES)
def test_a_stream_whose_gateway_died_is_finished_through_another_gateway_exactly(case, smollm2_tokenizer):
    body = BODIES[case]

    async def test(node, hold, a, url_a, url_b, http):
        first, stream_id, last_id = await _break_off(node, hold, a, http, url_a, body)
        hold.release()
        r = await http.get(f"{url_b}/v1/streams/{stream_id}", headers={"Last-Event-ID": last_id})
        assert r.status_code == 200, r.text
        rest = _events(r.text.splitlines())
        again = await http.get(f"{url_b}/v1/streams/{stream_id}", headers={"Last-Event-ID": last_id})
        reference = _events((await http.post(f"{url_b}/v1/completions", json=body, headers=SSE)).text.splitlines())
        return first, rest, reference, again

    first, rest, reference, again = _run(test, smollm2_tokenizer)
    assert rest[-1] == (None, "[DONE]")
    assert all(json.loads(d)["id"] == json.loads(first[0][1])["id"] for _, d in rest[:-1])
    n = body.get("n", 1)
    joined = [x + y for x, y in zip(_text(first, n), _text(rest, n), strict=True)]
    assert joined == _text(reference, n) and any(_text(first, n))  # every character once, some before the break
    assert _final(rest) == _final(reference)
    assert _final(rest)[1]["completion_tokens"] == 24 * body.get("n", 1)
    assert again.status_code == 404 and again.json()["error"]["type"] == "not_found_error"  # delivered: over


def test_forged_foreign_and_expired_stream_ids_are_refused(smollm2_tokenizer):
    body = BODIES["greedy"]

    async def test(node, hold, a, url_a, url_b, http):
        _, stream_id, last_id = await _break_off(node, hold, a, http, url_a, body)
        prefix, _, rest = stream_id.partition("-")
        payload, _, mac = rest.rpartition(".")
        forged = f"{prefix}-{payload}.{'A' * len(mac)}"
        answers = {
            "forged": await http.get(f"{url_b}/v1/streams/{forged}", headers={"Last-Event-ID": last_id}),
            "random": await http.get(f"{url_b}/v1/streams/cmpl-0123456789abcdef"),
            "foreign": await http.get(f"{url_b}/v1/streams/{stream_id}",
                                      headers={"Last-Event-ID": "cmpl-other/3"}),
        }
        await until(lambda: node.server.detached.expired, TIMEOUT, "the grace period over")
        hold.release()
        answers["expired"] = await http.get(f"{url_b}/v1/streams/{stream_id}", headers={"Last-Event-ID": last_id})
        return stream_id, answers

    stream_id, answers = _run(test, smollm2_tokenizer, grace_s=0.5)
    for name, r in answers.items():
        assert r.status_code == (400 if name == "foreign" else 404), (name, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert stream_id[:40] in answers["expired"].json()["error"]["message"]
