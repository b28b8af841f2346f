import asyncio
import json

import pytest

from benchmarks.client import EndpointProfile, RequestSpec, parse_sse_line, request_body, send_one, stream_routed

httpx = pytest.importorskip("httpx")


def test_request_body_token_ids_and_text():
    spec = RequestSpec((1, 2, 3), "a b c", 16)
    body = request_body("m", spec, EndpointProfile())
    assert body["prompt"] == [1, 2, 3] and body["ignore_eos"] is True and body["max_tokens"] == 16
    assert body["temperature"] == 0.0 and body["stream"] and body["stream_options"] == {"include_usage": True}
    text = request_body("m", spec, EndpointProfile(token_ids=False, extra_body={}, include_usage=False,
                                                   min_tokens=True))
    assert text["prompt"] == "a b c" and "stream_options" not in text and "ignore_eos" not in text
    assert text["min_tokens"] == 16


def test_parse_sse_line():
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line("data: [DONE]") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("") is None


def _sse(events):
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def _run(handler, profile=None):
    profile = profile or EndpointProfile()

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_one(client, "http://x/v1/completions", "m", RequestSpec((1, 2), "hi", 3), profile, 0.0)
    return asyncio.run(go())


def test_send_one_counts_tokens_and_uses_usage():
    events = [{"choices": [{"text": "a"}]}, {"choices": [{"text": ""}]}, {"choices": [{"text": "b"}]},
              {"choices": [{"text": "c", "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}]
    rec = _run(lambda req: httpx.Response(200, text=_sse(events)))
    assert rec.success, rec.error
    assert rec.output_tokens == 3 and rec.prompt_tokens == 2
    assert len(rec.itls) == 2 and rec.ttft is not None and rec.e2e >= rec.ttft


def test_send_one_without_usage_counts_chunks():
    events = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}]
    rec = _run(lambda req: httpx.Response(200, text=_sse(events)))
    assert rec.success and rec.output_tokens == 2


def test_send_one_records_http_errors():
    rec = _run(lambda req: httpx.Response(400, json={"error": {"message": "bad"}}))
    assert not rec.success and "HTTP 400" in rec.error and "bad" in rec.error
    rec = _run(lambda req: httpx.Response(200, text=_sse([])))
    assert not rec.success and "no tokens" in rec.error


def _routed(handler):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_routed(client, "http://x/v1/completions", {"prompt": [1, 2], "stream": True})
    return asyncio.run(go())


def test_stream_routed_reads_instance_ttft_usage_and_errors():
    events = [{"choices": [{"text": ""}]}, {"choices": [{"text": "a"}]},
              {"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 32}}}]
    got = _routed(lambda req: httpx.Response(200, text=_sse(events), headers={"x-xllm-instance": "e1"}))
    assert not got.error and got.instance == "e1" and got.cached_tokens == 32
    assert got.usage["completion_tokens"] == 1 and got.ttft is not None and got.e2e >= got.ttft
    failed = _routed(lambda req: httpx.Response(200, text=_sse([{"error": {"message": "boom"}}])))
    assert "boom" in failed.error and failed.e2e is None and failed.cached_tokens == 0
    refused = _routed(lambda req: httpx.Response(503, text="busy"))
    assert "HTTP 503" in refused.error and refused.instance is None
