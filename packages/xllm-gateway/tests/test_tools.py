"""The Hermes tool-call parser without a model: parsing, streaming deltas, prompt preparation, the
forced-call grammar (checked by llguidance), and the request → constraint mapping."""

from __future__ import annotations

import json

import pytest

from xllm.engine_api.grammar_spec import check
from xllm.gateway.openai.errors import APIError
from xllm.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from xllm.gateway.openai.structured import structured_output
from xllm.gateway.openai.tool_parsers import TOOL_PARSERS
from xllm.gateway.openai.tools import ToolChoice
from xllm.proto.engine.v1 import engine_pb2

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "now"}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture
def parser():
    return TOOL_PARSERS.create("qwen")  # the alias of hermes


def test_parse(parser):
    out = parser.parse(f"Let me add.\n{CALL}\n{CALL.replace('1', '5')}")
    assert out.content == "Let me add."
    assert [json.loads(c["function"]["arguments"]) for c in out.tool_calls] == [{"a": 1, "b": 2}, {"a": 5, "b": 2}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in out.tool_calls)
    assert parser.parse("no calls here").tool_calls == []
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parser.parse(broken).content == broken  # not a call: the text stays content
    # an unclosed call at the end of the output (the model stopped after the JSON) is a call
    assert parser.parse(CALL.removesuffix("</tool_call>")).tool_calls[0]["function"]["name"] == "add"


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_stream_deltas_equal_the_parse(parser, step):
    text = f"Sure <tool_call>\n{{}}\n</tool_call> then {CALL}\n{CALL}"
    stream = parser.stream()
    content, calls = "", []
    for i in range(0, len(text), step):
        c, d = stream.feed(text[i:i + step])
        content, calls = content + c, calls + d
        assert "<tool_call" not in c[-len("<tool_call"):] or "{}" in content  # a tag is never half sent
    c, d = stream.finish()
    content, calls = content + c, calls + d
    assert content == "Sure <tool_call>\n{}\n</tool_call> then "  # a non-call block stays content
    assert [d["index"] for d in calls] == [0, 1]
    assert [json.loads(d["function"]["arguments"]) for d in calls] == [{"a": 1, "b": 2}] * 2


def test_prepare_describes_tools_for_templates_without_them(parser):
    messages = [{"role": "user", "content": "add 1 and 2"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                {"role": "tool", "content": "3", "tool_call_id": "c"}]
    out = parser.prepare(messages, TOOLS, template_renders_tools=False)
    assert out[0]["role"] == "system" and '"name": "add"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[2]["content"] == CALL and "tool_calls" not in out[2]
    assert out[3]["content"] == "<tool_response>\n3\n</tool_response>"
    rendered = parser.prepare(messages, TOOLS, template_renders_tools=True)  # arguments as objects, as vLLM
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert [m["content"] for m in rendered] == [m["content"] for m in messages]


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("named", "now")])
def test_forced_grammar_is_valid(parser, choice):
    grammar = parser.forced_grammar(TOOLS, choice, parallel=True)
    check(engine_pb2.StructuredOutput(grammar=grammar, field="tool_choice"))
    assert ("body_1" in grammar) == (choice.mode == "required")


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **kw})


def test_request_constraints():
    assert structured_output(chat()) is None
    msg = structured_output(chat(response_format={"type": "json_object"}))
    assert msg.WhichOneof("constraint") == "json_schema" and msg.field == "response_format"
    msg = structured_output(CompletionRequest.model_validate({"prompt": "x", "guided_choice": ["a", "b"]}))
    assert list(msg.choice.values) == ["a", "b"] and msg.field == "guided_choice"
    msg = structured_output(chat(guided_grammar='root ::= "a" | "b"'))  # GBNF
    assert msg.field == "guided_grammar"
    with pytest.raises(APIError) as info:
        structured_output(chat(guided_json={"type": "object"}), tool_grammar='start: "x"')
    assert info.value.param == "guided_json"
    with pytest.raises(APIError) as info:
        structured_output(chat(guided_grammar="root ::= ("))
    assert info.value.status == 400 and info.value.param == "guided_grammar"
