"""The single-process composition (build_embedded) with the real SmolLM2 model, in-process, split over two
tensor-parallel ranks (this process and a worker)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from xllm.core import EngineConfig
from xllm.engine_api.tracing import TracingOptions
from xllm.gateway.embedded import ServeOptions, build_embedded
from xllm.models import DEFAULT_MODEL
from xllm.testing.otlp import OTLPReceiver
from xllm.testing.sse import sse_events

pytestmark = pytest.mark.real_model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def receiver():
    with OTLPReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def embedded(receiver):
    """``xllm serve --tensor-parallel-size 2 --otlp-traces-endpoint ...``'s app: the engine here, its worker rank a
    child process, request traces to ``receiver``."""
    from fastapi.testclient import TestClient

    cfg = EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, max_model_len=256, max_num_seqs=4,
                       tensor_parallel_size=2, num_threads=1)
    before = set(multiprocessing.active_children())
    app = build_embedded(ServeOptions(engine=cfg, progress=False,
                                      tracing=TracingOptions(receiver.grpc_endpoint, service_name="xllm-gateway")))
    (worker,) = set(multiprocessing.active_children()) - before
    with TestClient(app, raise_server_exceptions=False) as client:
        yield app, client
    # leaving the client ran the lifespan shutdown: the engine thread is gone, and the engine was closed (its
    # worker rank left on rank 0's SHUTDOWN, not because rank 0 vanished: that is exit status 1)
    (instance,) = app.state.gateway.registry.instances()
    assert not instance.engine.is_running
    worker.join(30)
    code = worker.exitcode
    if code is None:  # never told to stop: killed here, so the test fails instead of hanging at exit
        worker.kill()
        worker.join(10)
    assert code == 0


def test_embedded_serves_the_default_model(embedded):
    app, client = embedded
    assert app.state.gateway.default_model == DEFAULT_MODEL
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(DEFAULT_MODEL, 256)]
    assert client.get("/health").json()["status"] == "ok"


def test_embedded_greedy_chat(embedded):
    _, client = embedded
    body = {"messages": FRANCE, "temperature": 0, "max_tokens": 16}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    text = out["choices"][0]["message"]["content"]
    assert "Paris" in text
    assert out["choices"][0]["finish_reason"] == "stop"
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert events[-1] == "[DONE]"
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    assert streamed == text


def test_embedded_context_limit_and_metrics(embedded):
    _, client = embedded
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 300})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 3
    text = client.get("/metrics").text
    assert f'xllm:generation_tokens_total{{instance="engine-0",model_name="{DEFAULT_MODEL}"}}' in text
    assert f'xllm:num_requests_running{{instance="engine-0",model_name="{DEFAULT_MODEL}"}} 0.0' in text


def test_embedded_traces_reach_into_the_engine(embedded, receiver):
    """One process: the in-process engine's spans are children of the gateway's call span (own service name)."""
    _, client = embedded
    trace_id = "5" * 32
    r = client.post("/v1/chat/completions", json={"messages": FRANCE, "temperature": 0, "max_tokens": 8},
                    headers={"traceparent": f"00-{trace_id}-{'6' * 16}-01"})
    assert r.status_code == 200, r.text
    spans = receiver.wait_for(lambda got: {"engine.request", "POST /v1/chat/completions"} <= {
        s.name for s in got if s.trace_id == trace_id})
    mine = {s.name: s for s in spans if s.trace_id == trace_id}
    engine, call = mine["engine.request"], mine["engine.generate"]
    assert engine.parent_id == call.span_id and call.parent_id == mine["POST /v1/chat/completions"].span_id
    assert (engine.service, call.service) == ("xllm-engine", "xllm-gateway")
    assert engine.resource["xllm.instance_id"] == "engine-0"
    assert engine.attributes["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert mine["engine.prefill"].parent_id == engine.span_id and mine["engine.decode"].parent_id == engine.span_id
    # the page's recent requests hold the engine's spans too (one process, one ring)
    app, _ = embedded
    (recent,) = [t for t in app.state.gateway.recent_traces.recent() if t["trace_id"] == trace_id]
    assert {"engine.request", "engine.prefill", "engine.decode", "route"} <= {s["name"] for s in recent["spans"]}
