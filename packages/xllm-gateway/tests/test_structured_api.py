"""Structured outputs, tool calls and prompt logprobs through the API, with the official ``openai``
client, against the real engine on SmolLM2 (fp32; one embedded server for the module).

- ``response_format`` (``json_schema`` strict, ``json_object``) and vLLM's ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar`` (Lark and GBNF): outputs valid for their
  constraint (``jsonschema`` validates the schemas), chat and completions, streamed and not;
- invalid schemas, regexes and grammars, two constraints at once: 400 naming the field;
- tools: ``required`` and a named ``tool_choice`` give parsed ``tool_calls`` whose arguments are valid
  for the function's schema (streamed as OpenAI deltas, and not), ``finish_reason`` ``tool_calls``;
  ``auto`` / ``none``; ``tool`` role messages in the history;
- ``echo`` + ``logprobs`` and ``prompt_logprobs``: HF's teacher-forced logprobs (the second request
  finds the prompt in the prefix cache); ``best_of`` > ``n``; ``suffix`` refused.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import torch

from xllm.core import EngineConfig
from xllm.gateway.embedded import ServeOptions, build_embedded

pytestmark = pytest.mark.real_model

PERSON = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "pets", "role", "email"],
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "pets": {"type": "array", "maxItems": 2,
                 "items": {"type": "object", "additionalProperties": False, "required": ["kind", "legs"],
                           "properties": {"kind": {"enum": ["cat", "dog", "bird"]},
                                          "legs": {"type": "integer", "minimum": 0, "maximum": 4}}}},
        "role": {"enum": ["admin", "user"]},
        "email": {"type": "string", "pattern": "^[a-z]{2,8}@[a-z]{2,8}\\.com$"},
    },
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["tz"],
                   "properties": {"tz": {"type": "string", "maxLength": 24}}}}}
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def http():
    from fastapi.testclient import TestClient

    cfg = EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.1, max_model_len=768, max_num_seqs=8,
                       num_threads=1)
    app = build_embedded(ServeOptions(engine=cfg, progress=False))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0, http_client=http)


def chat(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", [{"role": "user", "content": "Describe a person as JSON."}])
    kw.setdefault("max_tokens", 160)
    return client.chat.completions.create(**kw)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 5}])
def test_json_schema_strict_is_valid(client, sampling):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = chat(client, response_format=rf, n=2, **sampling)
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_and_guided_json_streamed(client, http):
    msg = [{"role": "user", "content": "Reply with a JSON object with two keys: name and city."}]
    out = chat(client, messages=msg, response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    stream = client.completions.create(model=MODEL, prompt="A JSON record of a person:", max_tokens=160,
                                       temperature=0.7, seed=3, stream=True, extra_body={"guided_json": PERSON})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_a_schema_compiles_off_the_event_loop(client, monkeypatch):
    """The engine compiles a request's grammar (a cache miss) on a worker thread, never on the HTTP
    event loop (a large schema takes milliseconds); the output still follows it."""
    import asyncio

    from xllm.core.grammar import Grammars

    compile_, misses_on_loop = Grammars.compile, []

    def compile(self, msg):
        before = self.misses
        out = compile_(self, msg)
        if self.misses > before:
            misses_on_loop.append(asyncio._get_running_loop() is not None)
        return out

    monkeypatch.setattr(Grammars, "compile", compile)
    schema = {"type": "object", "additionalProperties": False, "required": ["off_loop"],
              "properties": {"off_loop": {"enum": ["yes", "no"]}}}  # a schema no other test uses: a miss
    out = client.completions.create(model=MODEL, prompt="Answer as JSON:", max_tokens=20, temperature=0,
                                    extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    assert misses_on_loop == [False]


def test_guided_choice_regex_and_grammars(client):
    out = chat(client, messages=ASK, temperature=0, max_tokens=8, extra_body={"guided_choice": ["sunny", "rainy"]})
    assert out.choices[0].message.content in ("sunny", "rainy")
    pattern = r"(\d{1,2}) (degrees|kelvin)"
    out = chat(client, messages=ASK, temperature=1.0, seed=1, max_tokens=12, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, out.choices[0].message.content)
    lark = 'start: "It is " temp " " unit\ntemp: /[0-9]{1,2}/\nunit: "C" | "F"'
    out = chat(client, messages=ASK, temperature=0, max_tokens=12, extra_body={"guided_grammar": lark})
    assert re.fullmatch(r"It is [0-9]{1,2} [CF]", out.choices[0].message.content)
    gbnf = 'root ::= "yes" | "no" | "maybe"'
    out = client.completions.create(model=MODEL, prompt="Is Paris in France? Answer:", max_tokens=4,
                                    temperature=0, extra_body={"guided_grammar": gbnf})
    assert out.choices[0].text in ("yes", "no", "maybe")


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_json": '{"type": "object"'}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_invalid_constraints_are_400_naming_the_field(http, body, param):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_parsed_and_valid(client, choice):
    out = chat(client, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False,
               temperature=0, max_tokens=80)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_calls_stream_as_deltas(client):
    stream = chat(client, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0.8, seed=2,
                  max_tokens=80, stream=True, parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_tool_results_in_the_history_and_auto_none(client):
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    out = chat(client, messages=history, tools=[WEATHER], temperature=0, max_tokens=30)
    c = out.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
    assert "21" in c.message.content  # the tool's result reached the model
    # "none": the tools are not offered, nothing is parsed
    out = chat(client, messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=20)
    assert out.choices[0].message.tool_calls is None


@torch.inference_mode()
def hf_prompt_logprobs(hf, ids: list[int]) -> list[float]:
    rows = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return rows.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def test_echo_logprobs_and_prompt_logprobs_equal_hf(client, smollm2_tokenizer, hf_smollm2_fp32):
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = smollm2_tokenizer.encode(prompt)
    expected = hf_prompt_logprobs(hf_smollm2_fp32, ids)
    for _ in range(2):  # the second time the prompt is in the prefix cache: recomputed, not lost
        out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=3,
                                        temperature=0)
        lp = out.choices[0].logprobs
        assert out.choices[0].text.startswith(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.tokens[:len(ids)] == smollm2_tokenizer.token_strings(ids)
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], expected)) < 1e-3
        assert len(lp.tokens) == len(ids) + 3 and lp.text_offset[0] == 0
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 1})
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for tok, row, want in zip(ids[1:], plp[1:], expected):
        assert abs(row[str(tok)]["logprob"] - want) < 1e-3


def test_best_of_returns_the_most_likely_and_suffix_is_refused(client, http):
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                    seed=4, n=2, best_of=4, logprobs=0)
    assert len(out.choices) == 2 and [c.index for c in out.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs) for c in out.choices]
    assert sums[0] >= sums[1]
    every = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                      seed=4, n=4, logprobs=0)
    best = sorted((sum(c.logprobs.token_logprobs) for c in every.choices), reverse=True)[:2]
    assert sums == pytest.approx(best, abs=1e-4)  # the same seeded draws, ranked
    for body, param in (({"suffix": "The end."}, "suffix"), ({"best_of": 1, "n": 2}, "best_of"),
                        ({"best_of": 3, "stream": True}, "best_of")):
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_constraints_and_prompt_logprobs_cross_the_engine_service(smollm2_dir, smollm2_fp32, smollm2_tokenizer):
    """Cluster mode: an engine behind its gRPC server enforces the constraint the message carries,
    returns the prompt's logprobs, and refuses an invalid constraint with the field named."""
    import asyncio

    from xllm.core import LLMEngine
    from xllm.engine.loader import load_grammars
    from xllm.engine_api.errors import InvalidRequestError
    from xllm.proto.engine.v1 import engine_pb2
    from xllm.testing.served import ServedEngine

    tok = smollm2_tokenizer
    engine = LLMEngine(smollm2_fp32, tok, EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05,
                                                       max_model_len=512, num_threads=1),
                       grammars=load_grammars(smollm2_dir, tok, smollm2_fp32.vocab_size))
    prompt = tok.apply_chat_template(ASK)

    def request(rid: str, structured: engine_pb2.StructuredOutput) -> engine_pb2.GenerateRequest:
        return engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=engine_pb2.SamplingParams(
            max_tokens=12, temperature=0.0, prompt_logprobs=0, structured=structured))

    async def run():
        served = await ServedEngine(engine, model=MODEL).start()
        try:
            ok = request("ok", engine_pb2.StructuredOutput(regex="(sunny|rainy), [0-9]{2} degrees"))
            chunks = [c async for c in await served.client.submit(ok)]
            with pytest.raises(InvalidRequestError) as info:
                await served.client.submit(request("bad", engine_pb2.StructuredOutput(regex="(", field="guided_regex")))
            return chunks, info.value
        finally:
            await served.stop()

    chunks, error = asyncio.run(run())
    assert re.fullmatch("(sunny|rainy), [0-9]{2} degrees", "".join(c.text for c in chunks))
    assert [e.token_id for c in chunks for e in c.prompt_logprobs] == prompt[1:]
    assert error.param == "guided_regex"
