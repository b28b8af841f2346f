"""The FastAPI app over a scripted engine client: routes, response shapes, SSE, errors and metrics."""

from __future__ import annotations

import pytest

from xllm.engine_api.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.fakes import FAKE_MAX_LEN, FAKE_MODEL
from xllm.testing.metrics import metric_value, parse_metrics
from xllm.testing.sse import sse_events

MSG = [{"role": "user", "content": "Hi"}]


def expected_text(engine, n: int) -> str:
    return "".join(engine.tokenizer.decode([t]) for t in engine.output_ids(n))


def assert_error(r, status: int, param=None, code=None, type_="invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert (err["type"], err["param"], err["code"]) == (type_, param, code), err
    return err


# ---- service endpoints -----------------------------------------------------------------------


def test_fake_instance(fake_state):
    assert (fake_state.default_model, fake_state.max_model_len) == (FAKE_MODEL, FAKE_MAX_LEN)


def test_models(fake_client):
    body = fake_client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"], m["max_model_len"]) for m in body["data"]] == [
        (FAKE_MODEL, "model", "xllm", FAKE_MAX_LEN)]


def test_health_ok_and_unhealthy(fake_client, fake_engine):
    r = fake_client.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "instances": {"fake-0": {"healthy": True, "status": "ok"}}}
    fake_engine.healthy = False
    r = fake_client.get("/health")
    assert r.status_code == 503
    assert r.json()["status"] == "unhealthy"


def test_health_without_instances_is_503(fake_client, fake_state):
    fake_state.registry.deregister("fake-0")
    assert fake_client.get("/health").status_code == 503


def test_metrics_gauges_come_from_the_live_load_report(fake_client, fake_engine):
    fake_engine.load_report = instance_pb2.LoadReport(instance_id="fake-0", num_running=3, num_waiting=2,
                                                      kv_usage=0.5)
    r = fake_client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert f'xllm:num_requests_running{{instance="fake-0",model_name="{FAKE_MODEL}"}} 3.0' in text
    assert f'xllm:num_requests_waiting{{instance="fake-0",model_name="{FAKE_MODEL}"}} 2.0' in text
    assert f'xllm:kv_cache_usage_perc{{instance="fake-0",model_name="{FAKE_MODEL}"}} 0.5' in text
    fake_engine.load_report = instance_pb2.LoadReport(instance_id="fake-0")
    assert f'xllm:num_requests_running{{instance="fake-0",model_name="{FAKE_MODEL}"}} 0.0' in \
        fake_client.get("/metrics").text


def test_the_gateway_counts_what_clients_saw_per_instance(fake_client, fake_engine):
    """Finished requests by reason, end-to-end latency and TPOT samples (``xllm:router_*``), measured by the
    gateway in every mode (a cluster's engines report no latency histograms), one per request streamed."""
    reasons = []
    for i, max_tokens in enumerate((3, 6, 6)):
        r = fake_client.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": f"p{i}",
                                                      "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        reasons.append(r.json()["choices"][0]["finish_reason"])
    m = parse_metrics(fake_client.get("/metrics").text)
    labels = {"model_name": FAKE_MODEL, "instance": "fake-0"}
    assert reasons == ["length"] * 3
    assert metric_value(m, "xllm:router_finished_requests_total", finished_reason="length", **labels) == 3
    assert metric_value(m, "xllm:router_request_latency_seconds_count", **labels) == 3
    # one token a chunk: TPOT samples from each request's third chunk on (1 + 4 + 4)
    assert metric_value(m, "xllm:router_time_per_output_token_seconds_count", **labels) == 9
    assert metric_value(m, "xllm:router_time_to_first_token_seconds_count", **labels) == 3


# ---- chat ------------------------------------------------------------------------------------


def test_chat_non_streaming(fake_client, fake_engine, smollm2_tokenizer):
    r = fake_client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == FAKE_MODEL
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": expected_text(fake_engine, 5)},
                                "logprobs": None, "finish_reason": "length"}]
    prompt = smollm2_tokenizer.apply_chat_template(MSG, add_generation_prompt=True)
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 5, "total_tokens": len(prompt) + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    (req,) = fake_engine.submitted
    assert list(req.prompt_token_ids) == prompt
    assert req.model == FAKE_MODEL
    assert req.sampling.max_tokens == 5 and req.sampling.temperature == 0
    assert req.request_id == f"{body['id']}-0"


def test_chat_default_max_tokens_fills_the_context(fake_client, fake_engine):
    r = fake_client.post("/v1/chat/completions", json={"messages": MSG})
    assert r.status_code == 200, r.text
    prompt_len = len(fake_engine.submitted[0].prompt_token_ids)
    assert fake_engine.submitted[0].sampling.max_tokens == FAKE_MAX_LEN - prompt_len
    assert r.json()["usage"]["total_tokens"] == FAKE_MAX_LEN


def test_chat_n_submits_seeded_choices(fake_client, fake_engine):
    r = fake_client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 3, "n": 3, "seed": 5})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [q.sampling.seed for q in fake_engine.submitted] == [5, 6, 7]
    assert len({q.request_id for q in fake_engine.submitted}) == 3
    assert body["usage"]["completion_tokens"] == 9
    assert body["usage"]["prompt_tokens"] == len(fake_engine.submitted[0].prompt_token_ids)


def test_chat_logprobs(fake_client, fake_engine, smollm2_tokenizer):
    r = fake_client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, "logprobs": True,
                                                       "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    tok = fake_engine.output_ids(2)
    for entry, t in zip(content, tok):
        s = smollm2_tokenizer.token_strings([t])[0]
        assert entry["token"] == s and entry["bytes"] == list(s.encode()) and entry["logprob"] == -0.5
        assert [x["logprob"] for x in entry["top_logprobs"]] == [-0.5, -1.5]
        assert entry["top_logprobs"][0]["token"] == s


def test_chat_stream(fake_client, fake_engine):
    r = fake_client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == expected_text(fake_engine, 4)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]


def test_chat_stream_usage_options(fake_client, fake_engine):
    body = {"messages": MSG, "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(fake_client.post("/v1/chat/completions", json=body).text)
    assert events[-1] == "[DONE]"
    final = events[-2]
    prompt_len = len(fake_engine.submitted[0].prompt_token_ids)
    assert final["choices"] == []
    assert final["usage"]["completion_tokens"] == 6
    assert final["usage"]["prompt_tokens"] == prompt_len
    assert final["usage"]["total_tokens"] == prompt_len + 6
    content_chunks = [e for e in events[:-2] if e["choices"][0]["delta"].get("content")]
    assert all(e["usage"]["prompt_tokens"] == prompt_len for e in content_chunks)  # continuous usage
    assert {e["choices"][0]["index"] for e in content_chunks} == {0, 1}
    for i in (0, 1):
        counts = [e["usage"]["completion_tokens"] for e in content_chunks if e["choices"][0]["index"] == i]
        assert counts == [1, 2, 3]


def test_chat_context_length_exceeded(fake_client, fake_engine):
    long = [{"role": "user", "content": "word " * 200}]
    assert_error(fake_client.post("/v1/chat/completions", json={"messages": long}), 400, "messages",
                 "context_length_exceeded")
    assert fake_engine.submitted == []


# ---- completions -----------------------------------------------------------------------------


def test_completion_multiple_prompts_and_n(fake_client, fake_engine, smollm2_tokenizer):
    r = fake_client.post("/v1/completions", json={"prompt": ["Hello", "Good morning"], "max_tokens": 2, "n": 2})
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == expected_text(fake_engine, 2) for c in body["choices"])
    lens = [len(smollm2_tokenizer.encode(p)) for p in ("Hello", "Good morning")]
    assert [len(q.prompt_token_ids) for q in fake_engine.submitted] == [lens[0], lens[0], lens[1], lens[1]]
    assert body["usage"]["prompt_tokens"] == sum(lens)
    assert body["usage"]["completion_tokens"] == 8


def test_completion_echo_and_logprobs(fake_client, fake_engine):
    r = fake_client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "echo": True, "logprobs": 1})
    choice = r.json()["choices"][0]
    gen = expected_text(fake_engine, 2)
    assert choice["text"] == "Hello" + gen
    lp = choice["logprobs"]
    # the prompt's tokens first (OpenAI's echo): the first has no logprob; the engine computes the
    # rest (this scripted one sends none), then the completion's
    assert fake_engine.submitted[0].sampling.prompt_logprobs == 1
    assert lp["tokens"][0] == "Hello" and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"][1:]) == gen
    assert lp["token_logprobs"][1:] == [-0.5, -0.5]
    assert lp["text_offset"][:2] == [0, len("Hello")]
    assert lp["text_offset"][2] == len("Hello") + len(lp["tokens"][1])
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])


def test_completion_token_prompts(fake_client, fake_engine):
    r = fake_client.post("/v1/completions", json={"prompt": [[1, 2, 3], [4]], "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert [list(q.prompt_token_ids) for q in fake_engine.submitted] == [[1, 2, 3], [4]]
    assert_error(fake_client.post("/v1/completions", json={"prompt": [10**9], "max_tokens": 1}), 400, "prompt")
    assert_error(fake_client.post("/v1/completions", json={"prompt": [-1], "max_tokens": 1}), 400, "prompt")
    assert_error(fake_client.post("/v1/completions", json={"prompt": [1] * FAKE_MAX_LEN, "max_tokens": 1}), 400,
                 "prompt", "context_length_exceeded")


def test_completion_stream(fake_client, fake_engine):
    r = fake_client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "stream": True, "echo": True,
                                                  "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    chunks = events[:-2]
    assert all(c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello" + expected_text(fake_engine, 3)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("exc", "status", "param", "code", "type_"), [
    (InvalidRequestError("prompt plus max_tokens too long", "max_tokens"), 400, "max_tokens", None,
     "invalid_request_error"),
    (EngineOverloadedError("queue full"), 503, None, "overloaded", "server_overloaded"),
    (EngineDeadError("engine gone"), 503, None, None, "server_unavailable"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_submit_errors(fake_client, fake_engine, exc, status, param, code, type_, stream):
    fake_engine.submit_error = exc
    for path, body in (("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "x"})):
        r = fake_client.post(path, json={**body, "max_tokens": 2, "stream": stream})
        err = assert_error(r, status, param, code, type_)
        if isinstance(exc, EngineDeadError):  # its text may hold internals: logged, not shown
            assert str(exc) not in err["message"] and "request id req_" in err["message"]
        else:
            assert err["message"] == str(exc)
        if status == 503:
            assert r.headers["retry-after"] == "1"


def test_engine_error_mid_stream_ends_the_stream_with_an_error_event(fake_client, fake_engine):
    fake_engine.stream_error = EngineDeadError("engine crashed")
    fake_engine.error_after = 2
    for path, body in (("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "x"})):
        r = fake_client.post(path, json={**body, "max_tokens": 5, "stream": True})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert (err["type"], err["param"], err["code"]) == ("server_unavailable", None, None)
        assert "crashed" not in err["message"] and "request id" in err["message"]


def test_engine_error_without_stream_is_an_error_response(fake_client, fake_engine):
    fake_engine.stream_error = EngineDeadError("engine crashed")
    fake_engine.error_after = 1
    r = fake_client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, "n": 2})
    assert_error(r, 503, type_="server_unavailable")


def test_unknown_model_and_validation(fake_client, fake_engine):
    assert_error(fake_client.post("/v1/chat/completions", json={"messages": MSG, "model": "gpt-4"}), 404, "model",
                 "model_not_found")
    assert_error(fake_client.post("/v1/completions", json={"prompt": 7}), 400, "prompt")
    err = assert_error(fake_client.post("/v1/chat/completions", json={"messages": MSG, "top_logprobs": 2}), 400,
                       "top_logprobs")
    assert err["message"] == "top_logprobs: requires logprobs to be true"
    r = fake_client.post("/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert assert_error(r, 400)["message"].startswith("request body is not valid JSON")
    for field, value in (("max_tokens", 10**10), ("top_k", 2**40), ("min_tokens", 2**40), ("priority", 2**40),
                         ("stop_token_ids", [2**40]), ("logit_bias", {str(2**40): 1})):
        r = fake_client.post("/v1/chat/completions", json={"messages": MSG, field: value})
        assert_error(r, 400, field)
    assert fake_engine.submitted == []


def test_unexpected_exception_is_an_openai_500_without_internals(fake_client, fake_engine, caplog):
    fake_engine.submit_error = RuntimeError("kaboom")
    r = fake_client.post("/v1/completions", json={"prompt": "x"})
    err = assert_error(r, 500, type_="internal_error")
    assert "kaboom" not in err["message"] and "RuntimeError" not in err["message"]
    assert f"(request id {r.headers['x-request-id']})" in err["message"]
    assert any(isinstance(rec.exc_info[1], RuntimeError) and r.headers["x-request-id"] in rec.getMessage()
               for rec in caplog.records if rec.exc_info)


def test_unexpected_exception_outside_the_engine_is_an_openai_500(fake_client, fake_state, monkeypatch):
    """A failure the serving code does not map (here: the template) reaches the generic handler."""
    def broken(*_a, **_kw):
        raise KeyError("internal detail")

    monkeypatch.setattr(fake_state.tokenizer, "apply_chat_template", broken)
    r = fake_client.post("/v1/chat/completions", json={"messages": MSG})
    err = assert_error(r, 500, type_="internal_error")
    assert "internal detail" not in err["message"] and r.headers["x-request-id"] in err["message"]


def test_abandoned_stream_is_released(fake_client, fake_engine):
    """Reading only part of a streamed response and closing it ends the engine-side stream."""
    fake_engine.chunk_delay = 0.01
    with fake_client.stream("POST", "/v1/completions",
                            json={"prompt": "x", "max_tokens": 10_000, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    assert fake_engine.submitted[0].request_id in fake_engine.abandoned


def test_unknown_route_and_method_get_openai_error_shape(fake_client):
    r = fake_client.get("/v1/nope")
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = fake_client.get("/v1/chat/completions")
    assert r.status_code == 405
    assert "error" in r.json()
