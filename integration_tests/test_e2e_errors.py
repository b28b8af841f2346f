"""Bad requests get the right HTTP status and an OpenAI-style error body, and leave the server usable."""

from __future__ import annotations

import httpx
import pytest

from xllm.models import DEFAULT_MODEL as MODEL

pytestmark = pytest.mark.real_model

MSG = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def assert_error(r, status: int, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == type_, err
    if param is not None:
        assert err["param"] == param, err
    assert err["code"] == code, err
    return err


def chat(**fields) -> dict:
    return {"messages": MSG, "max_tokens": 2, **fields}


def completion(**fields) -> dict:
    return {"prompt": "Hi", "max_tokens": 2, **fields}


# (path, body, expected param); every case must answer 400 invalid_request_error
BAD_REQUESTS = [
    pytest.param(CHAT, {"model": MODEL}, "messages", id="chat-missing-messages"),
    pytest.param(CHAT, {"messages": []}, "messages", id="chat-empty-messages"),
    pytest.param(CHAT, {"messages": "Hi"}, "messages", id="chat-messages-string"),
    pytest.param(CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages", id="chat-bad-role"),
    pytest.param(CHAT, {"messages": [{"content": "Hi"}]}, "messages", id="chat-message-without-role"),
    pytest.param(CHAT, chat(max_tokens="abc"), "max_tokens", id="chat-max-tokens-string"),
    pytest.param(CHAT, chat(max_tokens="5"), "max_tokens", id="chat-max-tokens-numeric-string"),
    pytest.param(CHAT, chat(max_tokens=2.5), "max_tokens", id="chat-max-tokens-float"),
    pytest.param(CHAT, chat(max_tokens=True), "max_tokens", id="chat-max-tokens-bool"),
    pytest.param(CHAT, chat(max_tokens=0), "max_tokens", id="chat-max-tokens-0"),
    pytest.param(CHAT, chat(max_tokens=-3), "max_tokens", id="chat-max-tokens-negative"),
    pytest.param(CHAT, chat(max_tokens=10**6), "max_tokens", id="chat-max-tokens-beyond-context"),
    pytest.param(CHAT, chat(max_tokens=10**10), "max_tokens", id="chat-max-tokens-beyond-uint32"),
    pytest.param(CHAT, chat(max_tokens=10**6, stream=True), "max_tokens", id="chat-stream-max-tokens-beyond-context"),
    pytest.param(CHAT, chat(temperature="hot"), "temperature", id="chat-temperature-string"),
    pytest.param(CHAT, chat(temperature=-0.5), "temperature", id="chat-temperature-negative"),
    pytest.param(CHAT, chat(temperature=2.5), "temperature", id="chat-temperature-above-2"),
    pytest.param(CHAT, chat(top_p=0), "top_p", id="chat-top-p-0"),
    pytest.param(CHAT, chat(top_p=1.5), "top_p", id="chat-top-p-1.5"),
    pytest.param(CHAT, chat(n=0), "n", id="chat-n-0"),
    pytest.param(CHAT, chat(stream="yes"), "stream", id="chat-stream-string"),
    pytest.param(CHAT, chat(stop=[""]), "stop", id="chat-empty-stop"),
    pytest.param(CHAT, chat(stop=[str(i) for i in range(17)]), "stop", id="chat-too-many-stops"),
    pytest.param(CHAT, chat(logit_bias={"abc": 1}), "logit_bias", id="chat-logit-bias-key"),
    pytest.param(CHAT, chat(logit_bias={"5": 500}), "logit_bias", id="chat-logit-bias-value"),
    pytest.param(CHAT, chat(top_logprobs=3), "top_logprobs", id="chat-top-logprobs-without-logprobs"),
    pytest.param(CHAT, chat(stream_options={"include_usage": True}), "stream_options",
                 id="chat-stream-options-without-stream"),
    pytest.param(CHAT, chat(min_tokens=5), "min_tokens", id="chat-min-tokens-above-max-tokens"),
    pytest.param(CHAT, chat(top_k=2**40), "top_k", id="chat-top-k-beyond-int32"),
    pytest.param(CHAT, chat(stop_token_ids=[2**40]), "stop_token_ids", id="chat-stop-token-id-beyond-int32"),
    pytest.param(COMPLETIONS, {"max_tokens": 2}, "prompt", id="completion-missing-prompt"),
    pytest.param(COMPLETIONS, completion(prompt=7), "prompt", id="completion-prompt-int"),
    pytest.param(COMPLETIONS, completion(prompt=""), "prompt", id="completion-empty-prompt"),
    pytest.param(COMPLETIONS, completion(prompt=[10**9]), "prompt", id="completion-token-beyond-vocab"),
    pytest.param(COMPLETIONS, completion(max_tokens="abc"), "max_tokens", id="completion-max-tokens-string"),
    pytest.param(COMPLETIONS, completion(max_tokens=0), "max_tokens", id="completion-max-tokens-0"),
    pytest.param(COMPLETIONS, completion(max_tokens=10**6), "max_tokens", id="completion-max-tokens-beyond-context"),
    pytest.param(COMPLETIONS, completion(temperature=-1), "temperature", id="completion-temperature-negative"),
    pytest.param(COMPLETIONS, completion(top_p=0), "top_p", id="completion-top-p-0"),
    pytest.param(COMPLETIONS, completion(top_p=1.5), "top_p", id="completion-top-p-1.5"),
    pytest.param(COMPLETIONS, completion(logprobs=6), "logprobs", id="completion-logprobs-above-5"),
    pytest.param(COMPLETIONS, completion(suffix="x"), "suffix", id="completion-suffix"),
    # unknown fields are refused, as OpenAI does (they used to be ignored)
    pytest.param(CHAT, chat(frobnicate=True), "frobnicate", id="chat-unknown-field"),
    pytest.param(COMPLETIONS, completion(guided_regex="a(b"), "guided_regex", id="completion-invalid-regex"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_bad_request_400(http, path, body, param):
    assert_error(http.post(path, json=body), 400, param)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("raw", [b"{not json", b'{"messages": [', b""], ids=["garbage", "truncated", "empty"])
def test_malformed_json_400(http, path, raw):
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("raw", [b"[]", b"null", b'"hello"'], ids=["array", "null", "string"])
def test_json_not_an_object_400(http, path, raw):
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400)


@pytest.mark.parametrize(("path", "body"), [(CHAT, chat(model="no-such-model")),
                                            (COMPLETIONS, completion(model="no-such-model")),
                                            (CHAT, chat(model="no-such-model", stream=True))])
def test_unknown_model_404(http, path, body):
    err = assert_error(http.post(path, json=body), 404, "model", "model_not_found")
    assert "no-such-model" in err["message"]


def test_prompt_longer_than_context_400(http, smollm2_tokenizer):
    text = "hello " * 9000
    assert len(smollm2_tokenizer.encode(text)) > 8192
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": text}], "max_tokens": 2})
    assert_error(r, 400, "messages", "context_length_exceeded")
    r = http.post(COMPLETIONS, json=completion(prompt=text))
    assert_error(r, 400, "prompt", "context_length_exceeded")
    r = http.post(COMPLETIONS, json=completion(prompt=[100] * 9000))
    assert_error(r, 400, "prompt", "context_length_exceeded")


def test_server_still_serves_after_bad_requests(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       temperature=0, max_tokens=8)
    assert r.choices[0].message.content
    assert r.usage.completion_tokens > 0


# ---- a second, small-context server (--max-model-len 64) -------------------------------------


@pytest.fixture(scope="module")
def small_server(launch_server):
    srv = launch_server("--max-model-len", "64", "--dtype", "float32", "--kv-cache-memory", "0.05",
                        "--max-num-seqs", "4")
    yield srv
    srv.stop()


def test_small_context_server(small_server, smollm2_tokenizer):
    with httpx.Client(base_url=small_server.url, timeout=120, trust_env=False) as h:
        models = h.get("/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, 64)]

        long_text = "one two three four five six seven eight nine ten " * 8
        assert len(smollm2_tokenizer.encode(long_text)) > 64
        assert_error(h.post(COMPLETIONS, json=completion(prompt=long_text)), 400, "prompt", "context_length_exceeded")
        assert_error(h.post(CHAT, json={"messages": [{"role": "user", "content": long_text}]}), 400, "messages",
                     "context_length_exceeded")

        prompt = "one two three four five six seven eight nine ten"
        n_prompt = len(smollm2_tokenizer.encode(prompt))
        assert n_prompt < 32
        # prompt + max_tokens must fit in the context
        assert_error(h.post(COMPLETIONS, json=completion(prompt=prompt, max_tokens=64 - n_prompt + 1)), 400,
                     "max_tokens")
        ok = h.post(COMPLETIONS, json=completion(prompt=prompt, max_tokens=64 - n_prompt, temperature=0,
                                                 ignore_eos=True))
        assert ok.status_code == 200, ok.text
        body = ok.json()
        assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 64 - n_prompt,
                                 "total_tokens": 64, "prompt_tokens_details": {"cached_tokens": 0}}
        assert body["choices"][0]["finish_reason"] == "length"
        # chat without max_tokens gets the rest of the context
        r = h.post(CHAT, json={"messages": MSG, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["total_tokens"] == 64
