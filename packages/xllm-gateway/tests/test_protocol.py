"""The OpenAI request schemas: strict types, ranges, cross-field rules, and every OpenAI field
implemented, harmlessly accepted or refused by name; unknown fields refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from xllm.gateway.openai.protocol import (
    INT32_MAX,
    UINT32_MAX,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Scheduling,
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


def test_unknown_fields_are_refused():
    for make in (chat, completion):
        with pytest.raises(ValidationError) as info:
            make(frobnicate=True)
        (err,) = info.value.errors()
        assert (err["type"], err["loc"]) == ("extra_forbidden", ("frobnicate",))
    with pytest.raises(ValidationError, match="Extra inputs"):
        chat(messages=[{"role": "user", "content": "x", "colour": "red"}])
    with pytest.raises(ValidationError):
        chat(stream=True, stream_options={"include_usage": True, "bogus": 1})
    with pytest.raises(ValidationError):
        completion(messages=MSG)  # a chat field on completions
    with pytest.raises(ValidationError):
        completion(tools=[])


# OpenAI fields refused with a 400 naming them (the value shown is one a client would send)
REFUSED = [
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
    ("reasoning_effort", "low"),
    ("verbosity", "low"),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("store", True),
    ("modalities", ["text", "audio"]),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),  # no schema
    ("tool_choice", "required"),  # without tools
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),  # not among the tools
]


@pytest.mark.parametrize(("field", "value"), REFUSED)
def test_unsupported_openai_fields_are_refused_by_name(field, value):
    with pytest.raises(ValidationError) as info:
        chat(**{field: value})
    assert error_locs(info.value) == {field}


@pytest.mark.parametrize(("field", "value"), [
    ("store", False), ("metadata", {"team": "a", "run": "7"}), ("parallel_tool_calls", False),
    ("response_format", {"type": "text"}), ("tool_choice", "none"), ("tool_choice", "auto"),
    ("service_tier", "auto"), ("service_tier", "default"), ("modalities", ["text"]), ("user", "u1"),
    ("safety_identifier", "h-123"), ("prompt_cache_key", "k"), ("prompt_cache_retention", "24h"),
    ("audio", None), ("prediction", None), ("functions", None), ("reasoning_effort", None),
])
def test_harmless_openai_fields_are_accepted(field, value):
    got = chat(**{field: value}).model_dump(exclude_none=True)
    assert got.get(field) == value


def test_metadata_follows_openais_bounds():
    chat(metadata={f"k{i}": "v" for i in range(16)})
    for bad in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}):
        with pytest.raises(ValidationError) as info:
            chat(metadata=bad)
        assert error_locs(info.value) == {"metadata"}


def test_completion_fields_of_openai():
    assert completion(echo=True, best_of=1, suffix="", user="u", seed=3).echo is True
    assert completion(response_format={"type": "text"}).response_format.type == "text"
    assert completion(response_format={"type": "json_object"}).response_format.type == "json_object"
    with pytest.raises(ValidationError):
        completion(response_format={"type": "json_object", "json_schema": {"name": "x", "schema": {}}})


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p",
                                   "repetition_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_are_refused(field, value):
    with pytest.raises(ValidationError) as info:
        chat(**{field: value})
    assert error_locs(info.value) == {field}
    with pytest.raises(ValidationError):
        chat(logit_bias={"1": value})


def test_priority_and_service_tier():
    """requested_priority: what asks to be served ahead of default requests (needs permission);
    lower priorities and flex are downgrades (None)."""
    assert chat().requested_priority() is None and chat().engine_priority() == 0
    assert chat(service_tier="default").requested_priority() is None
    assert chat(priority=-5).requested_priority() == ("priority", -5)
    assert chat(service_tier="priority").requested_priority() == ("service_tier", -1)
    assert chat(service_tier="flex").engine_priority() == 1 and chat(service_tier="flex").requested_priority() is None
    assert chat(service_tier="flex", priority=3).engine_priority() == 3
    assert chat(priority=3).requested_priority() is None
    assert completion(priority=2).engine_priority() == 2
    assert chat(service_tier="flex").scheduling() == Scheduling(1, True, "flex")
    assert completion(priority=2).scheduling(offline_priority=5) == Scheduling(2, False, "default")
    with pytest.raises(ValidationError) as info:
        chat(service_tier="platinum")
    assert error_locs(info.value) == {"service_tier"}


def test_affinity_key():
    assert chat().affinity_key() is None
    assert chat(user="u").affinity_key() == "u"
    assert chat(user="u", prompt_cache_key="k").affinity_key() == "k"
    assert chat(user="u", prompt_cache_key="k", session_id="s").affinity_key() == "s"
    assert completion(user="u").affinity_key() == "u"


@pytest.mark.parametrize("field", ["model", "user", "session_id", "prompt_cache_key"])
def test_identifiers_are_bounded(field):
    assert getattr(chat(**{field: "x" * 256}), field) == "x" * 256
    with pytest.raises(ValidationError) as info:
        chat(**{field: "x" * 257})
    assert error_locs(info.value) == {field}


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
    ("n", 0, 1), ("n", 129, 128),  # OpenAI's range; the server's bound is ApiLimits.max_n
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
    ("repetition_penalty", 0, 0.01), ("repetition_penalty", 100.5, 100),
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
    assert chat(stop=[str(i) for i in range(17)]).stop_list() == [str(i) for i in range(17)]  # counted by limits
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
    with pytest.raises(ValidationError, match="requires logprobs") as info:
        chat(top_logprobs=2)
    assert error_locs(info.value) == {"top_logprobs"}
    assert chat(top_logprobs=2, logprobs=True).top_logprobs == 2
    assert chat(top_logprobs=0).top_logprobs == 0  # 0 alternatives need nothing


def test_stream_options_require_stream():
    with pytest.raises(ValidationError, match="stream_options"):
        chat(stream_options={"include_usage": True})
    assert chat(stream=True, stream_options={"include_obfuscation": True}).stream_options.include_obfuscation
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
    for parts, match in (([{"type": "input_audio"}], "only text and image_url parts"),
                         ([{"type": "text", "text": "a"}, {"type": "input_audio"}], "content part 1"),
                         ([{"type": "text"}], "must be"), ([{"type": "text", "text": "a", "x": 1}], "must be"),
                         (["a"], "only text and image_url parts")):
        with pytest.raises(ValidationError, match=match) as info:
            chat(messages=[{"role": "user", "content": parts}])
        assert error_locs(info.value) == {"messages"}
    msg = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]).messages[0]
    assert msg.has_images() and msg.text() == "a"  # (the image part itself: xllm.gateway.media, 400s by field)
    assert msg.for_template()["content"] == [{"type": "text", "text": "a"}, {"type": "image"}]
    with pytest.raises(ValidationError, match="function"):
        chat(messages=[{"role": "function", "content": "x", "name": "f"}])
    for field, value in (("audio", {"id": "a1"}), ("function_call", {"name": "f", "arguments": "{}"})):
        with pytest.raises(ValidationError, match="not supported"):
            chat(messages=[{"role": "assistant", "content": None, field: value}])


def test_message_text_and_template_dict():
    parts = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]})
    assert parts.text() == "ab"
    assert ChatMessage.model_validate({"role": "assistant", "content": None}).text() == ""
    dev = ChatMessage.model_validate({"role": "developer", "content": "be brief", "name": "ops"})
    assert dev.for_template() == {"role": "system", "content": "be brief", "name": "ops"}
    assert ChatMessage.model_validate({"role": "user", "content": "x"}).for_template() == {"role": "user",
                                                                                          "content": "x"}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assistant = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call],
                                            "refusal": None, "annotations": [], "audio": None})
    assert assistant.for_template() == {"role": "assistant", "content": "", "tool_calls": [call]}
    tool = ChatMessage.model_validate({"role": "tool", "content": "42", "tool_call_id": "c1"})
    assert tool.for_template() == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    refused = ChatMessage.model_validate({"role": "assistant", "content": None, "refusal": "I can't."})
    assert refused.text() == "I can't."


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
        completion(best_of=1, n=2)
    with pytest.raises(ValidationError, match="best_of"):
        completion(best_of=3, n=2, stream=True)
    assert completion(best_of=3, n=2).best_of == 3
