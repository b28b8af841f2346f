"""The OpenAI request schemas: strict types, ranges and cross-field rules."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from xllm.gateway.openai.protocol import (
    INT32_MAX,
    UINT32_MAX,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)

MSG = [{"role": "user", "content": "Hi"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSG, **kw})


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "Hi", **kw})


def error_locs(exc: ValidationError) -> set[str]:
    return {str(e["loc"][0]) if e["loc"] else "" for e in exc.errors()}


def test_chat_defaults():
    r = chat()
    assert r.model is None
    assert r.n == 1
    assert r.temperature is None and r.top_p is None
    assert r.max_new_tokens() is None
    assert r.stream is False and r.stream_options is None
    assert r.stop_list() == []
    assert r.logprobs is False and r.top_logprobs is None
    assert r.ignore_eos is False and r.min_tokens == 0 and r.priority == 0
    assert r.skip_special_tokens is True
    assert r.messages[0].role == "user" and r.messages[0].text() == "Hi"


def test_completion_defaults():
    r = completion()
    assert r.max_tokens == 16
    assert r.logprobs is None
    assert r.echo is False
    assert r.prompts() == ["Hi"]


def test_unknown_fields_are_ignored():
    r = chat(frobnicate=True, service_tier="auto")
    assert not hasattr(r, "frobnicate")


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", "5"),
    ("max_tokens", 5.0),
    ("max_tokens", True),
    ("temperature", "0.5"),
    ("temperature", "hot"),
    ("top_p", "1"),
    ("n", "2"),
    ("n", 2.0),
    ("stream", "true"),
    ("stream", 1),
    ("seed", "1"),
    ("logprobs", "yes"),
    ("stop", 5),
    ("stop", ["a", 1]),
    ("model", 3),
    ("user", 3),
    ("logit_bias", {"1": "x"}),
    ("ignore_eos", "false"),
    ("stop_token_ids", ["1"]),
])
def test_strict_types_rejected(field, value):
    with pytest.raises(ValidationError) as info:
        chat(**{field: value})
    assert field in error_locs(info.value)


def test_int_is_accepted_for_float():
    assert chat(temperature=1).temperature == 1.0
    assert chat(top_p=1).top_p == 1.0


@pytest.mark.parametrize(("field", "bad", "good"), [
    ("n", 0, 1), ("n", 17, 16),
    ("temperature", -0.01, 0), ("temperature", 2.01, 2),
    ("top_p", 0, 0.01), ("top_p", 1.01, 1),
    ("presence_penalty", -2.5, -2), ("presence_penalty", 2.5, 2),
    ("frequency_penalty", -2.5, -2), ("frequency_penalty", 2.5, 2),
    ("seed", -1, 0), ("seed", 2**63, 2**63 - 1),
    ("max_tokens", 0, 1), ("max_tokens", UINT32_MAX + 1, UINT32_MAX),
    ("max_completion_tokens", 0, 1), ("max_completion_tokens", UINT32_MAX + 1, UINT32_MAX),
    ("top_logprobs", -1, 0), ("top_logprobs", 21, 20),
    ("top_k", -2, -1), ("top_k", INT32_MAX + 1, INT32_MAX),
    ("min_p", -0.1, 0), ("min_p", 1.1, 1),
    ("repetition_penalty", 0, 0.01),
    ("min_tokens", -1, 0), ("min_tokens", UINT32_MAX + 1, UINT32_MAX),
    ("priority", INT32_MAX + 1, INT32_MAX), ("priority", -INT32_MAX - 2, -INT32_MAX - 1),
])
def test_ranges(field, bad, good):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(ValidationError) as info:
        chat(**{field: bad}, **extra)
    assert field in error_locs(info.value)
    assert getattr(chat(**{field: good}, **extra), field) == good


@pytest.mark.parametrize(("bad", "good"), [(0, 1), (UINT32_MAX + 1, UINT32_MAX)])
def test_completion_max_tokens_range(bad, good):
    with pytest.raises(ValidationError):
        completion(max_tokens=bad)
    assert completion(max_tokens=good).max_tokens == good


def test_completion_logprobs_range():
    assert completion(logprobs=0).logprobs == 0
    assert completion(logprobs=5).logprobs == 5
    for bad in (-1, 6, True):
        with pytest.raises(ValidationError):
            completion(logprobs=bad)


def test_stop_list():
    assert chat(stop="x").stop_list() == ["x"]
    assert chat(stop=["a", "b"]).stop_list() == ["a", "b"]
    assert chat(stop=None).stop_list() == []
    assert chat(stop=[str(i) for i in range(16)]).stop_list() == [str(i) for i in range(16)]
    with pytest.raises(ValidationError, match="at most 16"):
        chat(stop=[str(i) for i in range(17)])
    with pytest.raises(ValidationError, match="non-empty"):
        chat(stop="")
    with pytest.raises(ValidationError, match="non-empty"):
        chat(stop=["a", ""])


def test_logit_bias_keys():
    assert chat(logit_bias={"0": 1, "42": -100, "49151": 100}).logit_bias == {"0": 1, "42": -100, "49151": 100}
    for key in ("abc", "-1", "1.5", "", " 3", "٣", str(INT32_MAX + 1)):
        with pytest.raises(ValidationError, match="logit_bias"):
            chat(logit_bias={key: 1})
    for value in (-100.5, 101):
        with pytest.raises(ValidationError):
            chat(logit_bias={"1": value})


def test_stop_token_ids_must_be_token_ids():
    assert chat(stop_token_ids=[0, 2]).stop_token_ids == [0, 2]
    for bad in (-1, INT32_MAX + 1):
        with pytest.raises(ValidationError):
            chat(stop_token_ids=[bad])


def test_top_logprobs_requires_logprobs():
    with pytest.raises(ValidationError, match="top_logprobs requires logprobs"):
        chat(top_logprobs=2)
    assert chat(top_logprobs=2, logprobs=True).top_logprobs == 2
    assert chat(top_logprobs=0).top_logprobs == 0  # 0 alternatives need nothing


def test_stream_options_require_stream():
    with pytest.raises(ValidationError, match="stream_options"):
        chat(stream_options={"include_usage": True})
    r = chat(stream=True, stream_options={"include_usage": True})
    assert r.stream_options.include_usage is True
    assert r.stream_options.continuous_usage_stats is False
    with pytest.raises(ValidationError):
        chat(stream=True, stream_options={"include_usage": "yes"})


def test_max_completion_tokens_wins():
    assert chat(max_tokens=5).max_new_tokens() == 5
    assert chat(max_completion_tokens=7).max_new_tokens() == 7
    assert chat(max_tokens=5, max_completion_tokens=7).max_new_tokens() == 7


def test_messages():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({})
    with pytest.raises(ValidationError):
        chat(messages="Hi")
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "user", "content": 5}])
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_message_text_and_template_dict():
    parts = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]})
    assert parts.text() == "ab"
    assert ChatMessage.model_validate({"role": "assistant", "content": None}).text() == ""
    dev = ChatMessage.model_validate({"role": "developer", "content": "be brief", "name": "ops"})
    assert dev.for_template() == {"role": "system", "content": "be brief", "name": "ops"}
    assert ChatMessage.model_validate({"role": "user", "content": "x"}).for_template() == {"role": "user",
                                                                                          "content": "x"}


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_completion_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", [[], [[]], 5, None, [1, "a"], [[1], "a"], [1.5], {"text": "x"}])
def test_completion_bad_prompts(prompt):
    with pytest.raises(ValidationError):
        completion(prompt=prompt)


def test_completion_missing_prompt():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"max_tokens": 3})
    assert "prompt" in error_locs(info.value)


def test_completion_unsupported_fields():
    with pytest.raises(ValidationError, match="suffix"):
        completion(suffix="!")
    with pytest.raises(ValidationError, match="best_of"):
        completion(best_of=3, n=2)
    assert completion(best_of=2, n=2).n == 2
