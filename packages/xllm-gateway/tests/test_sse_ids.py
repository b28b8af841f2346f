"""SSE event ids of streamed responses: ``<response id>/<tokens of each choice so far>``, what a client
reconnecting after a lost connection quotes as ``Last-Event-ID`` (EngineService.Reattach's offsets)."""

from __future__ import annotations

import itertools
import json

import pytest


def _events(text: str) -> list[tuple[str | None, str]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("id"), lines["data"]))
    return out


SSE = {"accept": "text/event-stream"}  # what EventSource sends


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_chunk_event_has_an_id_counting_each_choices_tokens(fake_client, path):
    body = {"max_tokens": 7, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    body.update({"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    r = fake_client.post(path, json=body, headers=SSE)
    assert r.status_code == 200, r.text
    events = _events(r.text)
    assert events[-1] == (None, "[DONE]")
    chunks = [(eid, json.loads(data)) for eid, data in events[:-1]]
    rid = chunks[0][1]["id"]
    counts = []
    for eid, chunk in chunks:
        prefix, _, offsets = eid.partition("/")
        assert prefix == rid == chunk["id"]
        counts.append([int(n) for n in offsets.split(",")])
    assert all(len(c) == 2 for c in counts)
    assert all(a[k] <= b[k] for a, b in itertools.pairwise(counts) for k in range(2))  # never back
    assert counts[-1] == [7, 7] and chunks[-1][1]["usage"]["completion_tokens"] == 14


def test_identical_streams_at_once_get_distinct_ids_and_both_complete(fake_client):
    """A stream id seals what the request asked (model, created, prompt lengths, ...) plus a nonce: two identical
    requests in the same second are two streams (equal ids collided in the engine: "already in flight")."""
    body = {"prompt": "hello", "max_tokens": 5, "stream": True}
    texts = [fake_client.post("/v1/completions", json=body, headers=SSE).text for _ in range(2)]
    ids = []
    for text in texts:
        events = _events(text)
        assert events[-1] == (None, "[DONE]") and all("error" not in json.loads(d) for _, d in events[:-1])
        ids.append(json.loads(events[0][1])["id"])
    assert ids[0] != ids[1]


@pytest.mark.parametrize("accept", [None, "*/*", "application/json"])
def test_clients_that_do_not_accept_event_streams_get_data_lines_only(fake_client, accept):
    """vLLM's benchmark client splits events and parses each as ``data: <json>``: an ``id:`` line broke every
    request it sent. Only a client that accepts ``text/event-stream`` (EventSource) gets ids."""
    body = {"prompt": "hello", "max_tokens": 4, "stream": True}
    r = fake_client.post("/v1/completions", json=body, headers={} if accept is None else {"accept": accept})
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    assert blocks and all(b.startswith("data: ") and "\n" not in b for b in blocks), r.text
    assert blocks[-1] == "data: [DONE]"
