"""Request traces across processes: ``xllm serve`` with one prefill and three decode engine processes (a tiny
random Llama, ``--drain-moves migrate``) and ``--otlp-traces-endpoint`` pointing at a real OTLP receiver on
loopback (the official ``opentelemetry-proto`` service; :mod:`xllm.testing.otlp`).

A PD request is one trace continuing the client's ``traceparent``: the gateway's spans, the prefill instance's
and the decode instance's, from three processes, each engine's root the child of the gateway span that called
it; the KV hand-off shows on both sides. Each faulted request equals its uninterrupted run (text, tokens,
finish reason, usage; seeded for the move, greedy for the resume). A request whose decode process drains
(SIGTERM) moves with its KV: the ``move`` span names both instances, the source hands off, the destination
receives the KV, all in the one trace. A request whose decode process is SIGKILLed mid-stream keeps one trace:
the broken call (error), the ``resume`` span naming both instances, and the new pair's spans; the gateway's
JSON log lines about it carry its request and trace ids."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal

import httpx
import pytest

from xllm.testing.otlp import OTLPReceiver
from xllm.testing.processes import engine_pid, frozen, wait_for
from xllm.testing.sse import assert_same_streams, stream_many

ROLES = {"prefill-0", "decode-0", "decode-1", "decode-2"}


@pytest.fixture(scope="module")
def receiver():
    with OTLPReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def gw(launch_server, tiny_model_dir, tiny_engine_flags, receiver):
    server = launch_server("--model", str(tiny_model_dir), "--served-model-name", "tiny", "--prefill-instances", "1",
                           "--decode-instances", "3", "--drain-moves", "migrate", *tiny_engine_flags,
                           "--otlp-traces-endpoint", receiver.grpc_endpoint, "--log-format", "json",
                           env={"OTEL_BSP_SCHEDULE_DELAY": "100"})  # spans exported within 0.1 s of their end
    try:
        def all_up():
            body = httpx.get(f"{server.url}/health", timeout=10, trust_env=False).json()
            return {k for k, v in body["instances"].items() if v["healthy"]} == ROLES

        wait_for(all_up, 120, "the prefill and decode engine processes registered")
        yield server
    finally:
        server.stop()


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _body(max_tokens: int, seed: int | None = None) -> dict:
    """A streamed completion: greedy, or seeded sampling with ``seed``; top-2 logprobs and usage, for
    :func:`~xllm.testing.sse.assert_same_streams`."""
    sampling = {"temperature": 0} if seed is None else {"temperature": 0.9, "top_p": 0.95, "seed": seed}
    return {"model": "tiny", "prompt": "The library opens at nine and closes at", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "logprobs": 2, "stream_options": {"include_usage": True},
            **sampling}


def _engine_roots(spans, trace_id: str) -> list:
    return [s for s in spans if s.trace_id == trace_id and s.name == "engine.request"]


def test_a_pd_request_is_one_trace_across_three_processes(gw, receiver):
    trace_id, client_span, header = _traceparent()
    (got,) = asyncio.run(stream_many(gw.url, [_body(24)], headers={"traceparent": header}))
    assert got.complete(24), got
    spans = receiver.wait_for(lambda s: len(_engine_roots(s, trace_id)) == 2
                              and any(x.trace_id == trace_id and x.name.startswith("POST") for x in s))
    mine = [s for s in spans if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in mine}
    root = next(s for s in mine if s.name == "POST /v1/completions")
    assert root.parent_id == client_span and root.service == "xllm-gateway"
    # every span hangs off the trace: its parent is in it (the root's is the client's span)
    assert all(s.parent_id in by_id for s in mine if s is not root), [(s.name, s.service) for s in mine]
    assert len({s.resource["process.pid"] for s in mine}) == 3  # gateway, prefill and decode processes
    engines = {s.resource["xllm.instance_id"]: s for s in _engine_roots(mine, trace_id)}
    assert set(engines) == {"prefill-0", got.instance} and got.instance.startswith("decode-")
    for iid, phase in (("prefill-0", "prefill"), (got.instance, "decode")):
        call = by_id[engines[iid].parent_id]  # the gateway's span of the call to that instance
        assert (call.name, call.service, call.kind) == ("engine.generate", "xllm-gateway", 3)
        assert call.attributes["xllm.instance_id"] == iid and call.attributes["xllm.phase"] == phase
        assert call.parent_id == root.span_id and engines[iid].attributes["xllm.phase"] == phase
    route = next(s for s in mine if s.name == "route")
    assert (route.attributes["xllm.route.prefill_instance"], route.attributes["xllm.route.decode_instance"]) == \
        ("prefill-0", got.instance)

    def children(iid: str) -> dict[str, list]:
        out: dict[str, list] = {}
        for s in mine:
            if s.parent_id == engines[iid].span_id:
                out.setdefault(s.name, []).append(s)
        return out

    prefill, decode = children("prefill-0"), children(got.instance)
    assert sum(s.attributes["xllm.chunk.tokens"] for s in prefill["engine.prefill"]) == \
        root_prompt_tokens(mine) and "kv.handoff" in prefill
    (transfer,) = decode["kv.transfer"]
    assert transfer.attributes["xllm.kv.transport"] == "fd" and transfer.attributes["xllm.kv.bytes"] > 0
    assert transfer.attributes["xllm.kv.outcome"] == "ok"
    (dec,) = decode["engine.decode"]
    assert dec.attributes["xllm.decode.tokens"] == 23  # the prefill instance sampled the first of 24
    assert engines[got.instance].attributes["xllm.phase"] == "decode" and "engine.queue" in decode


def root_prompt_tokens(spans) -> int:
    return next(s for s in spans if s.name == "tokenize").attributes["gen_ai.usage.input_tokens"]


def test_a_migrated_request_keeps_one_trace_across_both_decode_instances(gw, receiver):
    trace_id, _, header = _traceparent()
    drained: list[str] = []

    def drain_decode(streams) -> None:
        (s,) = streams
        pid = engine_pid(gw.proc.pid, s.instance)
        with frozen([pid]):  # it cannot finish first: the SIGTERM is handled when it runs again
            assert not s.finish
            os.kill(pid, signal.SIGTERM)
            drained.append(s.instance)

    body = _body(240, seed=7)  # seeded sampling (the resume test below is greedy)
    reference = asyncio.run(stream_many(gw.url, [body]))  # the same request, uninterrupted
    (got,) = asyncio.run(stream_many(gw.url, [body], action=drain_decode, headers={"traceparent": header}))
    assert got.complete(240), got
    assert_same_streams([got], reference, [False])  # text, tokens, finish reason and usage of one run
    wait_for(lambda: drained[0] not in _healthy(gw), 60, f"{drained[0]} drained and gone")
    spans = receiver.wait_for(lambda s: any(x.trace_id == trace_id and x.name.startswith("POST") for x in s)
                              and len(_engine_roots(s, trace_id)) >= 3)
    mine = [s for s in spans if s.trace_id == trace_id]
    (move,) = [s for s in mine if s.name == "move"]
    to = move.attributes["xllm.move.to"]
    assert move.attributes["xllm.move.mode"] == "migrated" and move.attributes["xllm.move.from"] == drained[0]
    assert move.attributes["xllm.move.cause"] == "drain" and to in ROLES - {"prefill-0", drained[0]}
    engines = {s.resource["xllm.instance_id"]: s for s in _engine_roots(mine, trace_id)}
    assert set(engines) == {"prefill-0", drained[0], to}
    kids = {iid: {s.name: s for s in mine if s.parent_id == root.span_id} for iid, root in engines.items()}
    assert "kv.handoff" in kids[drained[0]]  # the source handed the request off ...
    assert kids[to]["kv.transfer"].attributes["xllm.kv.bytes"] > 0  # ... its KV reached the destination
    assert engines[drained[0]].attributes["gen_ai.response.finish_reasons"] == ["handed_off"]
    calls = {s.attributes["xllm.instance_id"]: s for s in mine if s.name == "engine.generate"}
    assert engines[to].parent_id == calls[to].span_id and calls[to].status_code != 2


def _healthy(gw) -> set[str]:
    body = httpx.get(f"{gw.url}/health", timeout=10, trust_env=False).json()
    return {k for k, v in body["instances"].items() if v["healthy"]}


def test_a_resumed_request_keeps_one_trace_showing_the_failure_and_the_resume(gw, receiver):
    trace_id, _, header = _traceparent()
    killed: list[str] = []
    alive = _healthy(gw)  # (the previous test drained one decode instance)

    def kill_decode(streams) -> None:
        (s,) = streams
        pid = engine_pid(gw.proc.pid, s.instance)
        with frozen([pid]):  # it cannot finish first
            assert not s.finish
            os.kill(pid, signal.SIGKILL)
            killed.append(s.instance)

    reference = asyncio.run(stream_many(gw.url, [_body(160)]))  # the same request, uninterrupted
    (got,) = asyncio.run(stream_many(gw.url, [_body(160)], action=kill_decode, headers={"traceparent": header}))
    assert got.complete(160), got
    assert_same_streams([got], reference, [True])
    (other,) = alive - {"prefill-0", killed[0]}
    spans = receiver.wait_for(lambda s: any(x.trace_id == trace_id and x.name.startswith("POST") for x in s)
                              and any(x.resource["xllm.instance_id"] == other for x in _engine_roots(s, trace_id)))
    mine = [s for s in spans if s.trace_id == trace_id]
    (resume,) = [s for s in mine if s.name == "resume"]
    assert resume.attributes["xllm.resume.from"] == killed[0] and resume.attributes["xllm.resume.to"] == other
    assert resume.attributes["xllm.resume.mode"] == "recompute" and resume.attributes["xllm.resume.tokens_sent"] > 0
    broken = [s for s in mine if s.name == "engine.generate" and s.attributes["xllm.instance_id"] == killed[0]]
    assert len(broken) == 1 and broken[0].status_code == 2  # the call the kill broke
    # the killed process sent nothing more; the new pair traced the continuation under the same root
    roots = {(s.resource["xllm.instance_id"], s.attributes["xllm.resumed_output_tokens"] > 0)
             for s in _engine_roots(mine, trace_id)}
    assert (other, True) in roots and ("prefill-0", True) in roots and killed[0] not in {i for i, _ in roots}
    root = next(s for s in mine if s.name == "POST /v1/completions")
    assert root.attributes["gen_ai.usage.output_tokens"] == 160 and root.status_code != 2
    # the gateway's JSON log: the resume's warning names the request's trace
    lines = [json.loads(line) for line in gw.log_path.read_text().splitlines() if line.startswith("{")]
    assert any(line.get("trace_id") == trace_id and line.get("request_id") and "resuming" in line["message"]
               for line in lines), [ln for ln in lines if ln["level"] == "WARNING"][-5:]
