"""``/v1/responses``, ``/tokenize`` and ``/detokenize`` over a scripted engine, driven by the official ``openai``
client: the response object and its streamed events, conversations by ``previous_response_id`` (the prompt
the engine gets is the tokenizer's own rendering of the whole conversation), function calls both ways, the
store, errors naming the Responses fields, and the tokenizer routes against the tokenizer itself."""

from __future__ import annotations

import dataclasses
import json

import openai
import pytest
from fastapi.testclient import TestClient

from xllm.gateway.access import AccessPolicy
from xllm.gateway.app import GatewayState, create_app
from xllm.gateway.metrics import EngineMetrics
from xllm.gateway.registry import EmbeddedRegistry
from xllm.testing.fakes import FAKE_MODEL, FakeEngineClient

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def _client(engine: FakeEngineClient, tokenizer, **state) -> tuple[TestClient, openai.OpenAI]:
    registry = EmbeddedRegistry()
    registry.register(engine)
    app = create_app(GatewayState(registry=registry, tokenizer=tokenizer, metrics=EngineMetrics(),
                                  default_model=FAKE_MODEL, max_model_len=4096, **state))
    http = TestClient(app, raise_server_exceptions=False)
    return http, openai.OpenAI(base_url="http://testserver/v1", api_key="sk-x", http_client=http, max_retries=0)


@pytest.fixture
def served(smollm2_tokenizer, fake_tokens):
    engine = FakeEngineClient(smollm2_tokenizer, fake_tokens)
    http, client = _client(engine, smollm2_tokenizer)
    with http:
        yield engine, client, http


def _text(engine: FakeEngineClient, n: int) -> str:
    return "".join(engine.tokenizer.decode([t]) for t in engine.output_ids(n))


def test_a_response_and_its_conversation(served, smollm2_tokenizer):
    engine, client, _ = served
    first = client.responses.create(model=FAKE_MODEL, input="Hi", instructions="Be brief.", max_output_tokens=5)
    assert first.object == "response" and first.id.startswith("resp_") and first.model == FAKE_MODEL
    assert first.output_text == _text(engine, 5)
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert (first.usage.output_tokens, first.usage.total_tokens) == (5, first.usage.input_tokens + 5)
    # the engine got exactly what the model's template makes of instructions + input
    tok = smollm2_tokenizer
    assert list(engine.submitted[-1].prompt_token_ids) == tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    second = client.responses.create(model=FAKE_MODEL, input=[{"role": "user", "content": "Again?"}],
                                     previous_response_id=first.id, max_output_tokens=3)
    assert second.previous_response_id == first.id and second.output_text == _text(engine, 3)
    # the conversation goes on without the earlier instructions (OpenAI's rule), with the earlier answer
    assert list(engine.submitted[-1].prompt_token_ids) == tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
         {"role": "user", "content": "Again?"}])
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as gone:
        client.responses.create(model=FAKE_MODEL, input="x", previous_response_id=first.id)
    assert gone.value.body["param"] == "previous_response_id"


def test_streamed_events(served):
    engine, client, _ = served
    with client.responses.create(model=FAKE_MODEL, input="Hi", max_output_tokens=4, stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 4, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == _text(engine, 4) == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 4
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {events[2].item.id}
    # a streamed response is stored as well
    assert client.responses.retrieve(events[-1].response.id).output_text == text


def test_function_calls_both_ways(smollm2_tokenizer):
    engine = FakeEngineClient(smollm2_tokenizer, smollm2_tokenizer.encode(CALL, add_special_tokens=False))
    n = len(engine.tokens)
    http, client = _client(engine, smollm2_tokenizer)
    with http:
        answer = client.responses.create(model=FAKE_MODEL, input="Weather in Paris?", tools=WEATHER,
                                         max_output_tokens=n)
        (call,) = answer.output
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather",
                                                                       {"city": "Paris"})
        assert call.call_id.startswith("call_")
        with client.responses.create(model=FAKE_MODEL, input="Weather in Paris?", tools=WEATHER,
                                     max_output_tokens=n, stream=True) as stream:
            events = list(stream)
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" not in kinds
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert json.loads(done.arguments) == {"city": "Paris"}
        # the client runs the tool and answers: the call and its output reach the template
        follow = client.responses.create(
            model=FAKE_MODEL, tools=WEATHER, previous_response_id=answer.id, max_output_tokens=2,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
        assert follow.status == "incomplete"
        prompt = smollm2_tokenizer.decode(list(engine.submitted[-1].prompt_token_ids), skip_special_tokens=False)
        assert "sunny, 21 C" in prompt and "get_weather" in prompt


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "missing"}}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x" * 10}, None),
])
def test_errors_name_the_responses_field(served, body, param):
    _, _, http = served
    r = http.post("/v1/responses", json={"model": FAKE_MODEL, "max_output_tokens": 2, **body})
    if param is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_structured_output_through_text_format(served):
    engine, _, http = served
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = http.post("/v1/responses", json={"model": FAKE_MODEL, "input": "x", "max_output_tokens": 2,
                                         "text": {"format": {"type": "json_schema", "name": "A", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert json.loads(engine.submitted[-1].sampling.structured.json_schema) == schema
    assert r.json()["text"]["format"]["name"] == "A"


def test_store_false_keeps_nothing(served):
    _, client, _ = served
    r = client.responses.create(model=FAKE_MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_tokenize_and_detokenize(served, smollm2_tokenizer):
    _, _, http = served
    tok = smollm2_tokenizer
    r = http.post("/tokenize", json={"prompt": "Hello, world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello, world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 4096 and r["token_strs"] == tok.token_strings(r["tokens"])
    messages = [{"role": "user", "content": "Hi"}]
    r = http.post("/tokenize", json={"model": FAKE_MODEL, "messages": messages}).json()
    assert r["tokens"] == tok.apply_chat_template(messages) and r["token_strs"] is None
    back = http.post("/detokenize", json={"tokens": tok.encode("Hello, world", add_special_tokens=False)})
    assert back.json() == {"prompt": "Hello, world"}
    bad = http.post("/detokenize", json={"tokens": [tok.vocab_size]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404
    assert http.post("/tokenize", json={"prompt": "x", "messages": messages}).status_code == 400


def test_tokenizer_routes_need_the_key_when_keys_are_set(smollm2_tokenizer, fake_tokens):
    engine = FakeEngineClient(smollm2_tokenizer, fake_tokens)
    http, _ = _client(engine, smollm2_tokenizer, access=dataclasses.replace(
        AccessPolicy(), api_keys=frozenset({"sk-right"})))
    with http:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]}),
                           ("/v1/responses", {"input": "x"})):
            assert http.post(path, json=body).status_code == 401
            assert http.post(path, json=body, headers={"Authorization": "Bearer sk-right"}).status_code == 200
