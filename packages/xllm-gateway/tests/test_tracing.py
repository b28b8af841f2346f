"""The gateway's request traces over a scripted engine, received by a real OTLP endpoint (gRPC and HTTP):
the spans of a request, their parent links, the client's ``traceparent`` continued, sampling, the context
sent to the instance, errors, and nothing at all when tracing is off."""

from __future__ import annotations

import json
import logging
import secrets

import pytest
from fastapi.testclient import TestClient

from xllm.engine_api.logs import JsonFormatter, RequestContext
from xllm.engine_api.tracing import TracingOptions
from xllm.gateway.app import GatewayState, create_app
from xllm.gateway.metrics import EngineMetrics
from xllm.gateway.registry import EmbeddedRegistry
from xllm.gateway.tracing import gateway_tracing
from xllm.testing.fakes import FAKE_MODEL, FakeEngineClient
from xllm.testing.otlp import OTLPReceiver

MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def receiver():
    with OTLPReceiver() as r:
        yield r


class TracedApp:
    """A gateway app over a scripted engine that records the trace headers of each submit."""

    def __init__(self, tokenizer, tokens, options: TracingOptions) -> None:
        self.engine = FakeEngineClient(tokenizer, tokens)
        self.carriers: list[dict | None] = []
        submit = self.engine.submit

        async def submit_recording(req, trace=None):
            self.carriers.append(trace)
            return await submit(req, trace)

        self.engine.submit = submit_recording
        registry = EmbeddedRegistry()
        registry.register(self.engine)
        self.state = GatewayState(registry=registry, tokenizer=tokenizer, metrics=EngineMetrics(),
                                  default_model=FAKE_MODEL, max_model_len=128, **gateway_tracing(options))

    def __enter__(self) -> TestClient:
        self.client = TestClient(create_app(self.state), raise_server_exceptions=False)
        return self.client.__enter__()

    def __exit__(self, *exc) -> None:
        self.client.__exit__(*exc)  # the lifespan's end shuts the tracer down: what is queued is sent


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_request_is_one_trace_continuing_the_clients_context(receiver, smollm2_tokenizer, fake_tokens, protocol):
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    app = TracedApp(smollm2_tokenizer, fake_tokens, TracingOptions(endpoint, protocol, 1.0, "xllm-gateway"))
    trace_id, client_span, header = _traceparent()
    with app as client:
        r = client.post("/v1/chat/completions", json={"model": FAKE_MODEL, "messages": MSG, "max_tokens": 5,
                                                      "stream": True}, headers={"traceparent": header})
        assert r.status_code == 200
    spans = receiver.wait_for(lambda got: any(s.trace_id == trace_id and s.name.startswith("POST") for s in got))
    mine = {s.name: s for s in spans if s.trace_id == trace_id}
    assert {s.transport for s in mine.values()} == {"grpc" if protocol == "grpc" else "http"}
    root = mine["POST /v1/chat/completions"]
    assert root.parent_id == client_span and root.kind == 2 and root.service == "xllm-gateway"  # SERVER
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.usage.output_tokens"] == 5
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert root.attributes["xllm.http_request_id"] == r.headers["x-request-id"]
    assert 0 <= root.attributes["xllm.ttft_s"] <= root.seconds
    for name in ("validate", "tokenize", "route", "engine.generate"):
        assert mine[name].parent_id == root.span_id, name
        assert root.start_ns <= mine[name].start_ns <= mine[name].end_ns <= root.end_ns, name
    assert mine["tokenize"].attributes["gen_ai.usage.input_tokens"] > 0
    assert mine["route"].attributes["xllm.route.instance"] == app.engine.info.instance_id
    call = mine["engine.generate"]
    assert call.kind == 3 and call.attributes["xllm.instance_id"] == app.engine.info.instance_id  # CLIENT
    # the instance was sent the context of exactly that span
    assert app.carriers == [{"traceparent": f"00-{trace_id}-{call.span_id}-01"}]


def test_unsampled_requests_leave_no_spans_and_send_no_context(receiver, smollm2_tokenizer, fake_tokens):
    app = TracedApp(smollm2_tokenizer, fake_tokens, TracingOptions(receiver.grpc_endpoint, "grpc", 0.0, "gw-zero"))
    sampled_trace, _, sampled = _traceparent()
    unsampled_trace, _, header = _traceparent()
    with app as client:
        for h in ({}, {"traceparent": header[:-2] + "00"}, {"traceparent": sampled}):
            r = client.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "a b", "max_tokens": 2},
                            headers=h)
            assert r.status_code == 200
    # ratio 0: only the request whose client sampled it is traced (the lifespan's end flushed everything)
    spans = receiver.wait_for(lambda got: any(s.trace_id == sampled_trace and s.name.startswith("POST")
                                              for s in got))
    assert {s.trace_id for s in spans if s.service == "gw-zero"} == {sampled_trace}
    assert not any(s.trace_id == unsampled_trace for s in spans)
    assert app.carriers[:2] == [None, None] and app.carriers[2]["traceparent"].startswith(f"00-{sampled_trace}-")


def test_failures_mark_the_spans(receiver, smollm2_tokenizer, fake_tokens):
    app = TracedApp(smollm2_tokenizer, fake_tokens, TracingOptions(receiver.grpc_endpoint, "grpc", 1.0, "gw-err"))
    bad_trace, _, bad = _traceparent()
    dead_trace, _, dead = _traceparent()
    from xllm.engine_api.errors import EngineDeadError

    with app as client:
        r = client.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "a", "max_tokens": -1},
                        headers={"traceparent": bad})
        assert r.status_code == 400
        app.engine.submit_error = EngineDeadError("the engine died")
        r = client.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "a", "max_tokens": 2},
                        headers={"traceparent": dead})
        assert r.status_code >= 500
    spans = receiver.wait_for(lambda got: {dead_trace, bad_trace} <= {s.trace_id for s in got
                                                                       if s.name.startswith("POST")})
    bad_spans = {s.name: s for s in spans if s.trace_id == bad_trace}
    assert bad_spans["validate"].status_code == 2  # the body failed its checks here
    assert bad_spans["POST /v1/completions"].attributes["http.response.status_code"] == 400
    assert bad_spans["POST /v1/completions"].status_code != 2  # a client error is not the server's
    dead_spans = {s.name: s for s in spans if s.trace_id == dead_trace}
    assert dead_spans["engine.generate"].status_code == 2 and "died" in dead_spans["engine.generate"].status_message
    assert dead_spans["POST /v1/completions"].status_code == 2


def test_tracing_off_installs_nothing(smollm2_tokenizer, fake_tokens):
    app = TracedApp(smollm2_tokenizer, fake_tokens, TracingOptions())
    assert not app.state.tracing.enabled and app.state.recent_traces is None
    with app as client:
        r = client.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "a", "max_tokens": 2},
                        headers={"traceparent": _traceparent()[2]})
        assert r.status_code == 200
    assert app.carriers == [None]


def test_recent_traces_keep_the_gateways_spans_for_the_page(receiver, smollm2_tokenizer, fake_tokens):
    app = TracedApp(smollm2_tokenizer, fake_tokens, TracingOptions(receiver.grpc_endpoint, "grpc", 1.0, "gw-page"))
    with app as client:
        for _ in range(3):
            assert client.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "a b",
                                                        "max_tokens": 3}).status_code == 200
        recent = app.state.recent_traces.recent(2)
    assert len(recent) == 2 and recent[0]["start_unix"] >= recent[1]["start_unix"]
    names = [s["name"] for s in recent[0]["spans"]]
    assert names[0] == "POST /v1/completions" and {"validate", "tokenize", "route", "engine.generate"} <= set(names)
    root_id = recent[0]["spans"][0]["span_id"]
    assert all(s["parent_id"] == root_id for s in recent[0]["spans"][1:])
    assert recent[0]["status"] == 200 and recent[0]["request_id"].startswith("req_")


def test_json_log_lines_name_the_request_and_its_trace():
    from xllm.engine_api.logs import REQUEST_ID, TRACE_ID

    record = logging.LogRecord("xllm.test", logging.WARNING, __file__, 1, "resumed %s", ("x",), None)
    rid, tid = REQUEST_ID.set("req_1"), TRACE_ID.set("ab" * 16)
    try:
        RequestContext().filter(record)
    finally:
        REQUEST_ID.reset(rid)
        TRACE_ID.reset(tid)
    line = json.loads(JsonFormatter({"rank": 0}).format(record))
    assert line["message"] == "resumed x" and line["level"] == "WARNING" and line["logger"] == "xllm.test"
    assert (line["request_id"], line["trace_id"], line["rank"]) == ("req_1", "ab" * 16, 0)
    assert record.request_tag == " [req=req_1]"
