"""An engine instance's spans of traced requests, over gRPC (the context in the call's metadata) to a real
OTLP endpoint: children of the caller's span, the queue, each prefill chunk as the scheduler cut the prompt,
the decode with its token count, speculation's drafts, and nothing for an untraced call."""

from __future__ import annotations

import asyncio
import itertools
import math

import pytest

from xllm.core import AsyncEngine
from xllm.engine.server import EngineServer
from xllm.engine_api.client import GrpcEngineClient
from xllm.engine_api.tracing import Tracing, TracingOptions, end_span
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.engine import make_engine, make_request
from xllm.testing.otlp import OTLPReceiver

BUDGET = 16  # tokens per step: a 40-token prompt is three prefill chunks (16, 16, 8)


@pytest.fixture(scope="module")
def receiver():
    with OTLPReceiver() as r:
        yield r


async def _serve_and_call(receiver: OTLPReceiver, calls: list[tuple[engine_pb2.GenerateRequest, bool]], **config):
    """Serve a tiny engine with tracing on; make each call (traced or not) under one caller span; return the
    caller's span ids by request, and the chunks."""
    engine = make_engine(max_num_batched_tokens=BUDGET, **config)
    aeng = AsyncEngine(engine)
    engine_tracing = Tracing(TracingOptions(receiver.grpc_endpoint, service_name="test-engine"),
                             {"xllm.instance_id": "engine-0"}, roots=False)
    caller = Tracing(TracingOptions(receiver.grpc_endpoint, service_name="test-caller"))
    server = EngineServer(aeng, tracing=engine_tracing)
    aeng.start()
    port = await server.start("127.0.0.1", 0)
    client = GrpcEngineClient(instance_pb2.InstanceInfo(instance_id="engine-0", address=f"127.0.0.1:{port}"))
    parents, chunks = {}, {}
    try:
        for req, traced in calls:
            span = caller.start(f"call {req.request_id}", kind="client")
            carrier = caller.carrier(span) if traced else None
            chunks[req.request_id] = [c async for c in await client.submit(req, carrier)]
            parents[req.request_id] = (format(span.get_span_context().trace_id, "032x"),
                                       format(span.get_span_context().span_id, "016x"))
            end_span(span)
    finally:
        await client.close()
        await server.stop(0)
        aeng.shutdown()
        engine.close()
        engine_tracing.shutdown()
        caller.shutdown()
    return parents, chunks


def _spans_of(receiver: OTLPReceiver, trace_id: str, parent: str) -> dict:
    spans = receiver.wait_for(lambda got: any(s.trace_id == trace_id and s.name == "engine.request" for s in got))
    root = next(s for s in spans if s.trace_id == trace_id and s.name == "engine.request")
    assert root.parent_id == parent and root.kind == 2 and root.service == "test-engine"  # SERVER, caller's child
    children = [s for s in spans if s.trace_id == trace_id and s.parent_id == root.span_id]
    return {"root": root, "children": children}


def test_spans_follow_the_scheduler(receiver):
    prompt = list(range(3, 43))  # 40 tokens
    calls = [(make_request("traced", prompt, max_tokens=6, ignore_eos=True), True),
             (make_request("plain", prompt[:7], max_tokens=3, ignore_eos=True), False)]
    parents, chunks = asyncio.run(_serve_and_call(receiver, calls))
    trace_id, parent = parents["traced"]
    got = _spans_of(receiver, trace_id, parent)
    root = got["root"]
    assert root.attributes["xllm.request_id"] == "traced" and root.attributes["xllm.phase"] == "whole"
    assert root.attributes["gen_ai.usage.input_tokens"] == 40 and root.attributes["gen_ai.usage.output_tokens"] == 6
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert root.resource["xllm.instance_id"] == "engine-0" and root.status_code != 2
    by_name: dict[str, list] = {}
    for s in sorted(got["children"], key=lambda s: s.start_ns):
        by_name.setdefault(s.name, []).append(s)
    prefill = by_name["engine.prefill"]
    # the token budget cut the prompt: ceil(40 / 16) chunks of 16, 16, 8, one after another
    assert len(prefill) == math.ceil(40 / BUDGET)
    assert [s.attributes["xllm.chunk.tokens"] for s in prefill] == [16, 16, 8]
    assert all(a.end_ns <= b.start_ns for a, b in itertools.pairwise(prefill))
    (queue,), (decode,) = by_name["engine.queue"], by_name["engine.decode"]
    assert root.start_ns == queue.start_ns <= queue.end_ns <= prefill[0].start_ns
    assert prefill[-1].end_ns <= decode.start_ns <= decode.end_ns <= root.end_ns
    assert decode.attributes["xllm.decode.steps"] == 5 and decode.attributes["xllm.decode.tokens"] == 6
    assert decode.attributes["xllm.decode.tpot_s"] > 0
    assert "engine.speculation" not in by_name
    # the untraced call left no engine span at all
    assert not [s for s in receiver.spans if s.name == "engine.request" and s.attributes["xllm.request_id"] == "plain"]
    assert sum(len(c.token_ids) for c in chunks["plain"]) == 3


def test_speculation_shows_its_drafts(receiver):
    prompt = [5, 6, 7, 8] * 6  # repeats: the n-gram proposer drafts from it
    calls = [(make_request("spec", prompt, max_tokens=12, ignore_eos=True), True)]
    parents, chunks = asyncio.run(_serve_and_call(receiver, calls, speculative="ngram", num_speculative_tokens=3))
    trace_id, parent = parents["spec"]
    got = _spans_of(receiver, trace_id, parent)
    decode = next(s for s in got["children"] if s.name == "engine.decode")
    spec = [s for s in receiver.spans if s.trace_id == trace_id and s.name == "engine.speculation"]
    assert len(spec) == 1 and spec[0].parent_id == decode.span_id
    a = spec[0].attributes
    assert 0 < a["xllm.spec.steps"] <= decode.attributes["xllm.decode.steps"]
    assert 0 <= a["xllm.spec.accepted"] <= a["xllm.spec.drafted"] <= 3 * a["xllm.spec.steps"]
    # every output token came from a decode step or a draft it accepted (the prefill sampled the first)
    assert decode.attributes["xllm.decode.steps"] + a["xllm.spec.accepted"] == 12 - 1
    assert sum(len(c.token_ids) for c in chunks["spec"]) == 12
