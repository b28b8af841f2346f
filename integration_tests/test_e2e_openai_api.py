"""The OpenAI API of a real ``xllm serve`` process, driven by the official ``openai`` client."""

from __future__ import annotations

import pytest

from xllm.models import DEFAULT_MODEL as MODEL
from xllm.testing.metrics import metric_value

pytestmark = pytest.mark.real_model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE_PROMPT = "The capital of France is"


def _stream_chat(client, **kw):
    """Stream a chat completion; returns (texts per choice, finish reasons per choice, chunks)."""
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for ch in chunks:
        assert ch.object == "chat.completion.chunk"
        assert ch.model == MODEL
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                assert c.index not in finish, "finish_reason sent twice"
                finish[c.index] = c.finish_reason
    return texts, finish, chunks


def _stream_completion(client, **kw):
    chunks = list(client.completions.create(model=MODEL, stream=True, **kw))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for ch in chunks:
        assert ch.object == "text_completion"
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert c.index not in finish, "finish_reason sent twice"
                finish[c.index] = c.finish_reason
    return texts, finish, chunks


# ---- service endpoints -----------------------------------------------------------------------


def test_health_is_json_ok(http):
    r = http.get("/health")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["status"] == "ok"
    assert body["instances"] and all(i["healthy"] for i in body["instances"].values())


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"
    assert models[0].owned_by == "xllm"


# ---- chat ------------------------------------------------------------------------------------


def test_chat_greedy_answers_paris_and_counts_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=40,
                                       logprobs=True, top_logprobs=2)
    assert r.object == "chat.completion"
    assert r.model == MODEL
    assert r.id.startswith("chatcmpl-")
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # the model ends its answer well before 40 tokens
    entries = choice.logprobs.content
    u = r.usage
    assert u.prompt_tokens > 0
    assert 0 < u.completion_tokens < 40
    assert u.completion_tokens == len(entries)  # one logprob entry per generated token
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    for e in entries:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == 2
        # greedy: the chosen token is the most likely one
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob


def test_chat_without_model_uses_the_default(http):
    r = http.post("/v1/chat/completions", json={"messages": FRANCE, "temperature": 0, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL


def test_chat_finish_length_when_max_tokens_hit(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    assert r.choices[0].message.content


def test_chat_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_completion_tokens=2)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 2


def test_chat_stream_equals_non_stream(client):
    kw = {"messages": FRANCE, "temperature": 0, "max_tokens": 24}
    full = client.chat.completions.create(model=MODEL, **kw)
    texts, finish, chunks = _stream_chat(client, **kw)
    assert texts == {0: full.choices[0].message.content}
    assert finish == {0: full.choices[0].finish_reason}
    assert "Paris" in texts[0]
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant"
    assert len({ch.id for ch in chunks}) == 1
    assert all(ch.usage is None for ch in chunks), "usage sent without stream_options.include_usage"


def test_chat_stream_include_usage(client):
    kw = {"messages": FRANCE, "temperature": 0, "max_tokens": 5}
    full = client.chat.completions.create(model=MODEL, **kw)
    texts, finish, chunks = _stream_chat(client, stream_options={"include_usage": True}, **kw)
    assert texts[0] == full.choices[0].message.content
    assert finish == {0: "length"}
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens == full.usage.prompt_tokens > 0
    assert last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_n2_greedy(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=12, n=2,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert "Paris" in c.message.content
        assert c.finish_reason == "length"
    one = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=1)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once
    assert r.usage.completion_tokens == 2 * 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24


def test_chat_n2_stream_with_usage(client):
    texts, finish, chunks = _stream_chat(client, messages=FRANCE, temperature=1.0, seed=3, max_tokens=6, n=2,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    assert set(texts) == {0, 1}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_seed_reproducible(client):
    kw = {"messages": FRANCE, "temperature": 1.0, "max_tokens": 8, "seed": 1234}
    a = client.chat.completions.create(model=MODEL, **kw).choices[0].message.content
    b = client.chat.completions.create(model=MODEL, **kw).choices[0].message.content
    assert a == b


def test_chat_stop_string(client):
    full = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    text = full.choices[0].message.content
    assert "Paris" in text
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24, stop=["Paris"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index("Paris")]
    assert r.usage.completion_tokens < full.usage.completion_tokens
    texts, finish, _ = _stream_chat(client, messages=FRANCE, temperature=0, max_tokens=24, stop=["Paris"])
    assert texts[0] == r.choices[0].message.content
    assert finish == {0: "stop"}
    kept = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24,
                                          stop=["Paris"], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == text[: text.index("Paris") + len("Paris")]


def test_chat_ignore_eos_runs_to_max_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=20,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20


# ---- completions -----------------------------------------------------------------------------


def test_completion_greedy_paris(client):
    r = client.completions.create(model=MODEL, prompt=FRANCE_PROMPT, temperature=0, max_tokens=6, logprobs=1,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    c = r.choices[0]
    assert "Paris" in c.text
    assert c.finish_reason == "length"
    assert len(c.logprobs.tokens) == 6
    assert "".join(c.logprobs.tokens) == c.text
    assert r.usage.prompt_tokens > 0
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_completion_stream_equals_non_stream(client):
    kw = {"prompt": FRANCE_PROMPT, "temperature": 0, "max_tokens": 10}
    full = client.completions.create(model=MODEL, **kw)
    texts, finish, chunks = _stream_completion(client, **kw)
    assert texts == {0: full.choices[0].text}
    assert finish == {0: full.choices[0].finish_reason}
    assert all(ch.usage is None for ch in chunks)


def test_completion_stream_include_usage(client):
    texts, finish, chunks = _stream_completion(client, prompt=FRANCE_PROMPT, temperature=0, max_tokens=4,
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
    assert finish == {0: "length"}
    assert "Paris" in texts[0]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.prompt_tokens > 0
    assert last.usage.completion_tokens == 4
    assert last.usage.total_tokens == last.usage.prompt_tokens + 4


def test_completion_stop_string(client):
    r = client.completions.create(model=MODEL, prompt=FRANCE_PROMPT, temperature=0, max_tokens=16, stop=["."])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text.strip() == "Paris"
    texts, finish, _ = _stream_completion(client, prompt=FRANCE_PROMPT, temperature=0, max_tokens=16, stop=["."])
    assert texts == {0: r.choices[0].text}
    assert finish == {0: "stop"}


def test_completion_n2_and_prompt_batch(client):
    r = client.completions.create(model=MODEL, prompt=[FRANCE_PROMPT, "1, 2, 3, 4,"], temperature=0, max_tokens=3,
                                  n=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    # choices 0, 1 continue the first prompt, 2, 3 the second
    assert "Paris" in by_index[0] and "Paris" in by_index[1]
    assert "5" in by_index[2] and "5" in by_index[3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 12


def test_completion_echo_and_token_prompt(client, smollm2_tokenizer):
    echo = client.completions.create(model=MODEL, prompt=FRANCE_PROMPT, temperature=0, max_tokens=2, echo=True,
                                     extra_body={"ignore_eos": True})
    text = client.completions.create(model=MODEL, prompt=FRANCE_PROMPT, temperature=0, max_tokens=2,
                                     extra_body={"ignore_eos": True})
    assert echo.choices[0].text == FRANCE_PROMPT + text.choices[0].text
    # a pre-tokenized prompt gives the same greedy continuation as its text
    token_ids = smollm2_tokenizer.encode(FRANCE_PROMPT)
    tok = client.completions.create(model=MODEL, prompt=token_ids, temperature=0, max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert tok.choices[0].text == text.choices[0].text
    assert tok.usage.prompt_tokens == text.usage.prompt_tokens == len(token_ids)


# ---- metrics ---------------------------------------------------------------------------------


def test_metrics_exposes_vllm_style_names(client, http, scrape):
    before = scrape()
    gen_before = metric_value(before, "xllm:generation_tokens_total") if "xllm:generation_tokens_total" in before \
        else 0.0
    client.completions.create(model=MODEL, prompt=FRANCE_PROMPT, temperature=0, max_tokens=5,
                              extra_body={"ignore_eos": True})
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    for name in ("xllm:time_to_first_token_seconds", "xllm:inter_token_latency_seconds",
                 "xllm:num_requests_running", "xllm:num_requests_waiting", "xllm:prompt_tokens_total",
                 "xllm:generation_tokens_total"):
        assert name in r.text, name
    m = scrape()
    labels = {"model_name": MODEL}
    assert metric_value(m, "xllm:generation_tokens_total", **labels) >= gen_before + 5
    assert metric_value(m, "xllm:prompt_tokens_total", **labels) > 0
    assert metric_value(m, "xllm:time_to_first_token_seconds_count", **labels) >= 1
    assert metric_value(m, "xllm:inter_token_latency_seconds_count", **labels) >= 4
    assert metric_value(m, "xllm:num_requests_running", **labels) == 0
    assert metric_value(m, "xllm:num_requests_waiting", **labels) == 0
    assert metric_value(m, "xllm:request_success_total", finished_reason="length", **labels) >= 1


def test_responses_api_on_the_real_model(client, http):
    """``/v1/responses`` through the official client answers what chat completions answer for the same
    conversation (greedy), streamed or not, and continues it by ``previous_response_id``; ``/tokenize``
    counts what the usage counts."""
    chat = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    r = client.responses.create(model=MODEL, input=FRANCE[0]["content"], temperature=0, max_output_tokens=24)
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    with client.responses.create(model=MODEL, input=FRANCE[0]["content"], temperature=0, max_output_tokens=24,
                                 stream=True) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text
    again = client.responses.create(model=MODEL, input="And of Italy?", previous_response_id=r.id, temperature=0,
                                    max_output_tokens=24)
    follow = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=[
        *FRANCE, {"role": "assistant", "content": r.output_text}, {"role": "user", "content": "And of Italy?"}])
    assert again.output_text == follow.choices[0].message.content
    counted = http.post("/tokenize", json={"model": MODEL, "messages": FRANCE}).json()
    assert counted["count"] == chat.usage.prompt_tokens
