"""The app under abuse (fake engine): body size, the in-flight bound, work off the event loop,
request ids, Retry-After."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from xllm.gateway.app import create_app
from xllm.gateway.metrics import EngineMetrics
from xllm.gateway.openai.limits import ApiLimits
from xllm.testing.sse import sse_events

MSG = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
WAIT = 30.0  # failure guard of the event waits, never a timing assertion


@pytest.fixture
def app_with(fake_state):
    """``app_with(limits=...)``: a test client of an app over the fake engine with those settings."""
    from fastapi.testclient import TestClient

    clients = []

    def make(**changes):
        state = dataclasses.replace(fake_state, metrics=EngineMetrics(), **changes)
        c = TestClient(create_app(state), raise_server_exceptions=False)
        clients.append(c.__enter__())
        return c

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def test_body_size_limit(app_with, fake_engine):
    client = app_with(limits=ApiLimits(max_body_bytes=1000))
    body = b'{"prompt": "x", "max_tokens": 1}'
    assert client.post("/v1/completions", content=body + b" " * (1000 - len(body))).status_code == 200
    big = body + b" " * (1001 - len(body))
    r = client.post("/v1/completions", content=big)  # Content-Length: refused before reading
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large" and r.headers["connection"] == "close"

    def chunks():  # no Content-Length: counted while read
        for _ in range(20):
            yield b" " * 100

    r = client.post("/v1/completions", content=chunks())
    assert r.status_code == 413
    assert len(fake_engine.submitted) == 1
    r = client.post("/v1/completions", content=b"{}", headers={"content-length": "two"})
    assert r.status_code in (400, 413)  # never a 500


def test_inflight_bound_answers_503_with_retry_after(app_with, fake_engine):
    client = app_with(limits=ApiLimits(max_inflight_requests=1))
    fake_engine.chunk_delay = 0.01
    body = {"prompt": "x", "max_tokens": 10_000, "stream": True}
    with client.stream("POST", "/v1/completions", json=body, headers={"accept": "text/event-stream"}) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped line iterator would close the stream
        assert next(lines).startswith("id: ") and next(lines).startswith("data: ")  # the stream is being served
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("server_overloaded", "overloaded")
        assert r.headers["retry-after"] == "1"
        assert client.get("/health").status_code == 200  # not counted
        assert client.get("/v1/models").status_code == 200
        assert next(lines) == ""  # the held stream is still going
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})  # the stream has ended
    assert r.status_code == 200, r.text


def test_unhealthy_503_carries_retry_after(fake_client, fake_engine):
    fake_engine.healthy = False
    r = fake_client.get("/health")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"


def test_every_response_has_a_request_id(fake_client):
    ids = {fake_client.get("/health").headers["x-request-id"],
           fake_client.post(CHAT, json={"messages": MSG, "max_tokens": 1}).headers["x-request-id"],
           fake_client.post(CHAT, json={"messages": "x"}).headers["x-request-id"],
           fake_client.get("/v1/nope").headers["x-request-id"]}
    assert len(ids) == 4 and all(i.startswith("req_") for i in ids)


@pytest.mark.parametrize(("method", "path", "body"), [
    ("apply_chat_template", CHAT, {"messages": MSG, "max_tokens": 1}),
    ("encode", "/v1/completions", {"prompt": "a long prompt", "max_tokens": 1}),
])
def test_health_answers_while_a_prompt_is_tokenized(fake_client, fake_state, monkeypatch, method, path, body):
    """Templating and tokenization run off the event loop: with the tokenizer blocked inside a call,
    /health still answers (on the loop it could not: the test would fail by its timeout)."""
    tokenizer = fake_state.tokenizer
    real = getattr(tokenizer, method)
    entered, release = threading.Event(), threading.Event()

    def blocked(*args, **kwargs):
        entered.set()
        assert release.wait(WAIT)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, method, blocked)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(fake_client.post, path, json=body)
        try:
            assert entered.wait(WAIT), "the request never reached the tokenizer"
            assert fake_client.get("/health").status_code == 200
            assert not pending.done()
        finally:
            release.set()
        assert pending.result(WAIT).status_code == 200


def test_tiny_temperatures_are_raised_to_the_floor(fake_client, fake_engine):
    for t in (1e-45, 1e-5, 0.0, 0.5):
        assert fake_client.post(CHAT, json={"messages": MSG, "max_tokens": 1, "temperature": t}).status_code == 200
    sent = [q.sampling.temperature for q in fake_engine.submitted]
    assert sent == pytest.approx([0.01, 0.01, 0.0, 0.5])


def test_completion_stream_continuous_usage(fake_client, fake_engine):
    body = {"prompt": ["Hello", "Good morning"], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(fake_client.post("/v1/completions", json=body).text)
    lens = [len(q.prompt_token_ids) for q in fake_engine.submitted]
    chunks = [e for e in events[:-2] if e["choices"]]
    for i in (0, 1):
        usage = [e["usage"] for e in chunks if e["choices"][0]["index"] == i]
        assert [u["completion_tokens"] for u in usage] == [1, 2, 3]
        assert {u["prompt_tokens"] for u in usage} == {lens[i]}
    assert events[-2]["usage"]["completion_tokens"] == 6
