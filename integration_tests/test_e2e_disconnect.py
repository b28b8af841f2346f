"""A client that goes away mid-request frees its sequences in the engine."""

from __future__ import annotations

import httpx
import pytest

from xllm.models import DEFAULT_MODEL as MODEL
from xllm.testing.metrics import metric_value

pytestmark = pytest.mark.real_model

LONG = 8000  # near the context limit: at any CPU speed only an abort ends these requests within the 30 s wait


def _running(samples: dict) -> float:
    return metric_value(samples, "xllm:num_requests_running", model_name=MODEL)


def _read_chunks_then_close(server, path: str, body: dict, n_chunks: int = 3) -> list[str]:
    """Open a streaming request, read ``n_chunks`` SSE events, then drop the connection."""
    events = []
    with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as h, h.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) >= n_chunks:
                    break
    return events


def _generated(scrape) -> float:
    return metric_value(scrape(), "xllm:generation_tokens_total", True, model_name=MODEL)


@pytest.mark.parametrize(("path", "body", "n"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a very long story."}]}, 1),
    ("/v1/completions", {"prompt": "Once upon a time", "n": 2}, 2),
], ids=["chat", "completions-n2"])
def test_stream_disconnect_frees_sequence(server, client, scrape, wait_idle, path, body, n):
    wait_idle()
    gen_before = _generated(scrape)
    events = _read_chunks_then_close(server, path, {**body, "max_tokens": LONG, "ignore_eos": True, "stream": True,
                                                    "temperature": 0})
    assert len(events) == 3
    assert not any("[DONE]" in e for e in events)
    after = wait_idle(30.0)  # fails unless the engine drops the request(s) long before LONG tokens
    assert _running(after) == 0
    assert metric_value(after, "xllm:kv_cache_usage_perc", model_name=MODEL) == 0
    generated = _generated(scrape) - gen_before
    assert 0 < generated < n * LONG
    # the engine stays usable
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                        temperature=0, max_tokens=4)
    assert ok.choices[0].message.content
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_non_streaming_disconnect_frees_sequence(server, client, scrape, wait_idle):
    wait_idle()
    body = {"prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=2.0), trust_env=False) as h, \
            pytest.raises(httpx.ReadTimeout):
        h.post("/v1/completions", json=body)  # gives up (and closes) long before LONG tokens
    after = wait_idle(30.0)
    assert _running(after) == 0
    ok = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=2)
    assert ok.choices[0].text
