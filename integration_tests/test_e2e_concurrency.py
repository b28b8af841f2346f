"""Many concurrent streaming clients: all finish correctly and the engine batches their decode steps."""

from __future__ import annotations

import asyncio

import openai
import pytest

from xllm.models import DEFAULT_MODEL as MODEL
from xllm.testing.metrics import metric_value

pytestmark = pytest.mark.real_model

NUM_REQUESTS = 16
MAX_TOKENS = 24


def _multi_seq_decode_steps(samples: dict, missing_ok: bool = False) -> float:
    """Decode steps that ran more than one sequence: all observations minus those in the le=1 bucket."""
    count = metric_value(samples, "xllm:decode_batch_size_count", missing_ok, model_name=MODEL)
    single = metric_value(samples, "xllm:decode_batch_size_bucket", missing_ok, model_name=MODEL, le="1.0")
    return count - single


async def _one(client: openai.AsyncOpenAI, i: int) -> dict:
    """One streaming request; chat for even i, completions for odd i."""
    common = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.7, "seed": i, "stream": True,
              "stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
    text, finish, usage, logprob_tokens = "", [], None, 0
    if i % 2 == 0:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": f"Tell me fact number {i} about the sea."}], logprobs=True,
            **common)
        async for ch in stream:
            for c in ch.choices:
                text += c.delta.content or ""
                logprob_tokens += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
                if c.finish_reason:
                    finish.append(c.finish_reason)
            if ch.usage is not None:
                usage = ch.usage
    else:
        stream = await client.completions.create(prompt=f"Story {i}: Once upon a time", logprobs=0, **common)
        async for ch in stream:
            for c in ch.choices:
                text += c.text
                logprob_tokens += len(c.logprobs.tokens) if c.logprobs else 0
                if c.finish_reason:
                    finish.append(c.finish_reason)
            if ch.usage is not None:
                usage = ch.usage
    return {"i": i, "text": text, "finish": finish, "usage": usage, "tokens": logprob_tokens}


async def _run_all(base_url: str) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300,
                                http_client=openai.DefaultAsyncHttpxClient(trust_env=False))
    try:
        return await asyncio.gather(*(_one(client, i) for i in range(NUM_REQUESTS)))
    finally:
        await client.close()


def test_concurrent_streams_complete_and_share_decode_steps(server, wait_idle):
    before = wait_idle()

    results = asyncio.run(_run_all(f"{server.url}/v1"))

    assert len(results) == NUM_REQUESTS
    for r in results:
        assert r["finish"] == ["length"], r
        assert r["usage"] is not None, r
        assert r["usage"].completion_tokens == MAX_TOKENS, r
        assert r["usage"].prompt_tokens > 0
        assert r["usage"].total_tokens == r["usage"].prompt_tokens + MAX_TOKENS
        assert r["tokens"] == MAX_TOKENS, r  # one logprob entry per generated token
        assert r["text"], r

    after = wait_idle()

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, model_name=MODEL, **labels) - \
            metric_value(before, name, True, model_name=MODEL, **labels)

    assert delta("xllm:generation_tokens_total") == NUM_REQUESTS * MAX_TOKENS
    assert delta("xllm:request_success_total", finished_reason="length") == NUM_REQUESTS
    # every token after a request's first comes from a decode step
    assert delta("xllm:decode_batch_size_sum") == NUM_REQUESTS * (MAX_TOKENS - 1)
    shared = _multi_seq_decode_steps(after) - _multi_seq_decode_steps(before, True)
    assert shared > 0, "no decode step ran more than one sequence: the requests were not batched"
    assert delta("xllm:decode_batch_size_count") < NUM_REQUESTS * (MAX_TOKENS - 1)
