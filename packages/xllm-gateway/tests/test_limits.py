"""The request limits (ApiLimits) and the body -> request path: strict JSON, lone surrogates,
non-finite numbers, nesting, and each limit answered as a 400 naming its field."""

from __future__ import annotations

import json

import pytest

from xllm.gateway.openai.errors import APIError
from xllm.gateway.openai.limits import ApiLimits
from xllm.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from xllm.gateway.openai.request_body import parse_request

MSG = [{"role": "user", "content": "Hi"}]
LIMITS = ApiLimits()


def raw(body: dict) -> bytes:
    """JSON as a client may send it: ASCII escapes (so lone surrogates survive), NaN/Infinity literals."""
    return json.dumps(body, allow_nan=True).encode()


def parse_chat(limits: ApiLimits = LIMITS, **fields) -> ChatCompletionRequest:
    return parse_request(raw({"messages": MSG, **fields}), ChatCompletionRequest, limits)


def parse_completion(limits: ApiLimits = LIMITS, **fields) -> CompletionRequest:
    return parse_request(raw({"prompt": "Hi", **fields}), CompletionRequest, limits)


def refused(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error" and err.message
    return err


# ---- ApiLimits -----------------------------------------------------------------------------------


def test_defaults():
    d = ApiLimits()
    assert (d.max_body_bytes, d.max_prompt_chars, d.max_prompts, d.max_n, d.max_logprobs) == (
        8 * 1024 * 1024, 1_000_000, 64, 16, 20)
    assert d.max_inflight_requests is None


@pytest.mark.parametrize("kwargs", [{"max_n": 0}, {"max_n": 129}, {"max_body_bytes": -1}, {"max_logprobs": 21},
                                    {"max_logprobs": -1}, {"max_inflight_requests": 0}, {"max_stop": 1.5}])
def test_bad_limits(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ApiLimits(**kwargs)


# ---- JSON -> request ------------------------------------------------------------------------------

SURROGATE = "\ud800"


@pytest.mark.parametrize(("model", "body", "param"), [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": f"a{SURROGATE}b"}]}, "messages"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "name": SURROGATE}]}, "messages"),
    (ChatCompletionRequest, {"messages": MSG, "model": SURROGATE}, "model"),
    (ChatCompletionRequest, {"messages": MSG, "stop": ["ok", SURROGATE]}, "stop"),
    (ChatCompletionRequest, {"messages": MSG, "logit_bias": {f"1{SURROGATE}": 1}}, "logit_bias"),
    (ChatCompletionRequest, {"messages": MSG, "user": SURROGATE}, "user"),
    (ChatCompletionRequest, {"messages": MSG, "session_id": SURROGATE}, "session_id"),
    (ChatCompletionRequest, {"messages": MSG, "metadata": {SURROGATE: "v"}}, "metadata"),
    (ChatCompletionRequest, {"messages": MSG, "tools": [{"type": "function", "function": {"name": SURROGATE}}]},
     "tools"),
    (ChatCompletionRequest, {"messages": MSG, SURROGATE: 1}, "\\ud800"),  # an unknown key, named escaped
    (CompletionRequest, {"prompt": SURROGATE}, "prompt"),
    (CompletionRequest, {"prompt": ["fine", f"x{SURROGATE}"]}, "prompt"),
])
def test_lone_surrogates_are_refused_naming_the_field(model, body, param):
    err = refused(parse_request, raw(body), model, LIMITS)
    assert err.param == param
    assert "surrogate" in err.message
    err.response()  # the body can be encoded (an echoed key's surrogate is escaped)


def test_a_surrogate_encoded_in_the_raw_bytes_is_refused_too():
    """Python's JSON reader decodes UTF-8 with surrogatepass: b"\xed\xa0\x80" becomes U+D800."""
    err = refused(parse_request, b'{"prompt": "\xed\xa0\x80"}', CompletionRequest, LIMITS)
    assert err.param == "prompt" and "surrogate" in err.message


def test_paired_surrogates_are_a_character():
    req = parse_chat(messages=[{"role": "user", "content": "smile \U0001F600"}])
    assert req.messages[0].text() == "smile \U0001F600"
    assert b"\\ud83d\\ude00" in raw({"x": "\U0001F600"})  # what was parsed: an escaped pair


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "presence_penalty", "min_p"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_refused(field, literal):
    body = json.dumps({"messages": MSG}).removesuffix("}") + f', "{field}": {literal}}}'
    err = refused(parse_request, body.encode(), ChatCompletionRequest, LIMITS)
    assert err.param == field
    err = refused(parse_request, raw({"messages": MSG, "tools": [{"x": float("nan")}]}), ChatCompletionRequest,
                  LIMITS)
    assert err.param == "tools"  # also where no schema types the value


@pytest.mark.parametrize(("body", "match"), [
    (b"", "empty"), (b"  ", "empty"), (b"[]", "JSON object"), (b"null", "JSON object"), (b'"x"', "JSON object"),
    (b"{oops", "not valid JSON"), (b'{"messages": [', "not valid JSON"), (b'{"prompt": "\xff"}', "UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "deeper"),
])
def test_malformed_bodies(body, match):
    err = refused(parse_request, body, CompletionRequest, LIMITS)
    assert match in err.message and err.param is None


def test_nesting_is_bounded():
    deep: object = "x"
    for _ in range(40):
        deep = [deep]
    err = refused(parse_chat, tools=[{"type": "function", "function": {"parameters": deep}}])
    assert err.param == "tools" and "deeper than 32" in err.message
    shallow: object = "x"
    for _ in range(20):
        shallow = [shallow]
    assert parse_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"default": shallow}}}]).tools


def test_unknown_fields_are_named():
    err = refused(parse_chat, frobnicate=1)
    assert (err.message, err.param) == ("Unrecognized request argument supplied: frobnicate", "frobnicate")


# ---- limits ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 17}, "n"),
    ({"stop": [str(i) for i in range(17)]}, "stop"),
    ({"stop": "x" * 257}, "stop"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}] * 1025}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 1_000_001}]}, "messages"),
    ({"tools": [{"type": "function", "function": {"description": "x" * 1_000_000}}]}, "tools"),
])
def test_chat_limits(fields, param):
    assert refused(parse_chat, **fields).param == param


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 17}, "n"),
    ({"best_of": 17}, "best_of"),  # best_of fans out to that many engine requests, like n
    ({"best_of": 160}, "best_of"),
    ({"prompt": ["x"] * 65}, "prompt"),
    ({"prompt": ["x" * 600_000, "y" * 400_001]}, "prompt"),
    ({"stop": ["a"] * 17}, "stop"),
])
def test_completion_limits(fields, param):
    assert refused(parse_completion, **fields).param == param


def test_limits_at_their_bound_pass():
    req = parse_chat(n=16, stop=["x" * 256] * 16, stop_token_ids=list(range(256)),
                     logit_bias={str(i): 1 for i in range(300)}, logprobs=True, top_logprobs=20,
                     messages=[{"role": "user", "content": "x" * 1000}] * 1000)
    assert req.n == 16
    assert len(parse_completion(prompt=["x"] * 64, logprobs=5).prompts()) == 64
    assert parse_completion(best_of=16, n=16).best_of == 16
    assert parse_completion(prompt=[1] * 100_000).prompts() == [[1] * 100_000]  # token ids: no char count


def test_configured_limits():
    tight = ApiLimits(max_n=2, max_logprobs=1, max_prompts=2, max_prompt_chars=10)
    assert refused(parse_chat, tight, n=3).param == "n"
    assert parse_chat(tight, n=2).n == 2
    assert refused(parse_completion, tight, best_of=3).param == "best_of"
    assert parse_completion(tight, best_of=2).best_of == 2
    assert refused(parse_chat, tight, logprobs=True, top_logprobs=2).param == "top_logprobs"
    assert parse_chat(tight, top_logprobs=0).top_logprobs == 0
    assert refused(parse_completion, tight, logprobs=2).param == "logprobs"
    assert refused(parse_completion, tight, prompt=["a", "b", "c"]).param == "prompt"
    assert refused(parse_completion, tight, prompt="x" * 11).param == "prompt"
    assert parse_completion(tight, prompt="x" * 10).prompt == "x" * 10
    assert refused(parse_chat, tight, messages=[{"role": "user", "content": "12345", "name": "123456"}]).param == \
        "messages"
