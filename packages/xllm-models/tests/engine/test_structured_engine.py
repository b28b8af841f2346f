"""Constrained decoding and prompt logprobs in the engine, on SmolLM2 (fp32).

- JSON-schema outputs (nested objects, arrays, enums, required, integers with bounds, numbers,
  strings with patterns) are valid for the schema (``jsonschema``, an independent validator) under
  greedy and seeded sampled decoding, batched with unconstrained requests, with synchronous and
  async scheduling — and async scheduling (masks for step k+1 computed after step k's token landed)
  gives the same tokens as synchronous;
- the grammar state follows the sequence through preemption (recompute) and a resumed request
  (earlier output in the prompt): the outputs equal an uninterrupted run;
- prompt logprobs equal HF's teacher-forced ``log_softmax`` with chunked prefill, with async
  scheduling, and when the prompt's blocks are in the prefix cache (the cache is not used for such
  a request: a cached block has no logits; a request without prompt logprobs still hits it).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.engine.loader import load_grammars
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import Collected, run_to_completion

pytestmark = pytest.mark.real_model

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "address", "tags", "status", "code"],
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height": {"type": "number"},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
        "status": {"enum": ["active", "inactive", "banned"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    },
}
MAX_TOKENS = 150


@pytest.fixture(scope="module")
def grammars(smollm2_dir, smollm2_tokenizer, smollm2_fp32):
    return load_grammars(smollm2_dir, smollm2_tokenizer, smollm2_fp32.vocab_size)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    asks = ["Describe a user of our website as JSON.", "Give me a JSON record of a customer from Berlin."]
    return [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": a}]) for a in asks]


def engine(model, tok, grammars, **config) -> LLMEngine:
    config.setdefault("max_model_len", 512)
    return LLMEngine(model, tok, EngineConfig(dtype=torch.float32, num_threads=1, kv_cache_memory_gib=0.05,
                                              **config), grammars=grammars)


def schema_request(rid: str, prompt: list[int], schema: dict = SCHEMA, **sampling) -> engine_pb2.GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", MAX_TOKENS)
    structured = engine_pb2.StructuredOutput(json_schema=json.dumps(schema), field="response_format")
    return engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                      sampling=engine_pb2.SamplingParams(structured=structured, **sampling))


def run(eng: LLMEngine, reqs: list[engine_pb2.GenerateRequest]) -> Collected:
    ready = [c for r in reqs for c in eng.add_request(r)]
    got = run_to_completion(eng)
    got.add(ready)
    return got


def batch(prompts: list[list[int]]) -> list[engine_pb2.GenerateRequest]:
    """Greedy and seeded sampled constrained requests beside an unconstrained one."""
    return [
        schema_request("greedy0", prompts[0]),
        schema_request("greedy1", prompts[1]),
        schema_request("sampled0", prompts[0], temperature=0.9, seed=7),
        schema_request("sampled1", prompts[1], temperature=1.0, top_p=0.95, seed=11),
        engine_pb2.GenerateRequest(request_id="free", prompt_token_ids=prompts[0],
                                   sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=12)),
    ]


@pytest.fixture(scope="module")
def sync_run(smollm2_fp32, smollm2_tokenizer, grammars, prompts) -> Collected:
    return run(engine(smollm2_fp32, smollm2_tokenizer, grammars), batch(prompts))


def assert_valid(got: Collected, rids) -> None:
    for rid in rids:
        assert got.final[rid].finish_reason == engine_pb2.FINISH_REASON_STOP, (rid, got.text[rid])
        jsonschema.validate(json.loads(got.text[rid]), SCHEMA)


def test_schema_outputs_are_valid_greedy_and_sampled(sync_run, smollm2_tokenizer):
    assert_valid(sync_run, ["greedy0", "greedy1", "sampled0", "sampled1"])
    assert sync_run.text["greedy0"] != sync_run.text["sampled0"]  # the draws did sample
    assert not sync_run.text["free"].startswith("{")  # the unconstrained neighbour is free text


@pytest.mark.parametrize("overlap", [True, False])
def test_async_scheduling_gives_the_same_tokens(smollm2_fp32, smollm2_tokenizer, grammars, prompts, sync_run,
                                                overlap):
    """Async scheduling, the masks computed beside the forward (a spare core) or before it."""
    eng = engine(smollm2_fp32, smollm2_tokenizer, grammars, async_scheduling=True)
    grammars.overlap = overlap
    assert run(eng, batch(prompts)).tokens == sync_run.tokens


def test_grammar_state_survives_preemption(smollm2_fp32, smollm2_tokenizer, grammars, prompts, sync_run):
    """Offline constrained requests preempted (recompute) for online ones' slots: same tokens."""
    eng = engine(smollm2_fp32, smollm2_tokenizer, grammars, max_num_seqs=2)
    got = Collected()
    for r in (schema_request("greedy0", prompts[0]), schema_request("sampled0", prompts[0], temperature=0.9, seed=7)):
        r.offline = True
        got.add(eng.add_request(r))
    for _ in range(12):
        got.add(eng.step())
    for i, p in enumerate(prompts):
        got.add(eng.add_request(engine_pb2.GenerateRequest(
            request_id=f"online{i}", prompt_token_ids=p, sampling=engine_pb2.SamplingParams(temperature=0.0,
                                                                                            max_tokens=4))))
    while eng.has_work():
        got.add(eng.step())
    assert eng.counters.num_preemptions >= 1
    for rid in ("greedy0", "sampled0"):
        assert got.tokens[rid] == sync_run.tokens[rid]


def test_resumed_request_feeds_its_earlier_output_to_the_grammar(smollm2_fp32, smollm2_tokenizer, grammars,
                                                                 prompts, sync_run):
    for rid, sampling in (("greedy1", {}), ("sampled1", {"temperature": 1.0, "top_p": 0.95, "seed": 11})):
        earlier = sync_run.tokens[rid][:9]
        req = schema_request(rid, prompts[1] + earlier, **sampling)
        req.resumed_output_tokens = len(earlier)
        got = run(engine(smollm2_fp32, smollm2_tokenizer, grammars), [req])
        assert earlier + got.tokens[rid] == sync_run.tokens[rid]


def test_invalid_constraints_are_refused_naming_their_field(smollm2_fp32, smollm2_tokenizer, grammars, prompts):
    from xllm.engine_api.errors import InvalidRequestError

    eng = engine(smollm2_fp32, smollm2_tokenizer, grammars)
    bad = [engine_pb2.StructuredOutput(json_schema='{"type": "strin"}', field="guided_json"),
           engine_pb2.StructuredOutput(regex="a(b", field="guided_regex"),
           engine_pb2.StructuredOutput(grammar="start: x", field="guided_grammar")]
    for msg in bad:
        req = engine_pb2.GenerateRequest(request_id="bad", prompt_token_ids=prompts[0],
                                         sampling=engine_pb2.SamplingParams(max_tokens=4, structured=msg))
        with pytest.raises(InvalidRequestError) as info:
            eng.add_request(req)
        assert info.value.param == msg.field
    eng_without = LLMEngine(smollm2_fp32, smollm2_tokenizer, EngineConfig(dtype=torch.float32, num_threads=1,
                                                                          kv_cache_memory_gib=0.05))
    with pytest.raises(InvalidRequestError):
        eng_without.add_request(schema_request("x", prompts[0]))


def test_choice_and_regex(smollm2_fp32, smollm2_tokenizer, grammars, prompts):
    choice = engine_pb2.StructuredOutput(choice=engine_pb2.StringList(values=["alpha", "beta gamma", "delta"]))
    regex = engine_pb2.StructuredOutput(regex=r"[A-Z][a-z]{2,5}-[0-9]{2}")
    sp = engine_pb2.SamplingParams
    reqs = [engine_pb2.GenerateRequest(request_id="choice", prompt_token_ids=prompts[0],
                                       sampling=sp(temperature=0.0, max_tokens=10, structured=choice)),
            engine_pb2.GenerateRequest(request_id="regex", prompt_token_ids=prompts[1],
                                       sampling=sp(temperature=1.0, seed=3, max_tokens=20, structured=regex))]
    got = run(engine(smollm2_fp32, smollm2_tokenizer, grammars), reqs)
    assert got.text["choice"] in ("alpha", "beta gamma", "delta")
    assert re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{2}", got.text["regex"]), got.text["regex"]


# ---- prompt logprobs ---------------------------------------------------------------------------

@torch.inference_mode()
def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    rows = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    return rows.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)


def prompt_lp_request(rid: str, prompt: list[int], k: int = 2) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                      sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=2,
                                                                         prompt_logprobs=k))


def collect_prompt_lp(eng: LLMEngine, reqs) -> dict[str, list[engine_pb2.TokenLogprob]]:
    out: dict[str, list] = {}
    chunks = [c for r in reqs for c in eng.add_request(r)]
    while eng.has_work():
        chunks += eng.step()
    for c in chunks:
        out.setdefault(c.request_id, []).extend(c.prompt_logprobs)
    return out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_equal_hf_with_chunks_and_a_prefix_hit(smollm2_fp32, smollm2_tokenizer, hf_smollm2_fp32,
                                                               prompts, async_scheduling):
    prompt = prompts[0] + prompts[1][1:]  # ~60 tokens: 4 chunks of 16
    eng = engine(smollm2_fp32, smollm2_tokenizer, None, max_num_batched_tokens=16, block_size=16,
                 async_scheduling=async_scheduling)
    expected = hf_prompt_logprobs(hf_smollm2_fp32, prompt)
    first = collect_prompt_lp(eng, [prompt_lp_request("a", prompt)])["a"]
    # the prompt's blocks are cached now: a plain request hits them, a prompt-logprobs one recomputes
    plain = run(eng, [engine_pb2.GenerateRequest(request_id="plain", prompt_token_ids=prompt,
                                                 sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=1))])
    assert plain.final["plain"].usage.cached_prompt_tokens >= 16
    again = collect_prompt_lp(eng, [prompt_lp_request("b", prompt)])["b"]
    for entries in (first, again):
        assert [e.token_id for e in entries] == prompt[1:]
        got = torch.tensor([e.logprob for e in entries])
        assert (got - expected).abs().max() < 1e-3
        assert all(len(e.top) == 2 and e.top[0].logprob >= e.top[1].logprob for e in entries)
