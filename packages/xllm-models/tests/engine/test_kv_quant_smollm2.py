"""SmolLM2-135M with a quantized KV cache (int8 / fp8_e4m3) against the model-dtype cache: the quality
the quantization costs, through prefix-cache hits and chunked prefill (exact agreement with a
fake-quantized reference under every KV feature is checked on the tiny model in xllm-core's tests).

Reference: the ``auto`` cache's greedy continuations and their logprobs. The quantized engine scores
the same continuations teacher-forced (prompt logprobs) and generates its own greedily."""

from __future__ import annotations

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.proto.engine.v1 import engine_pb2

NEW = 10
SYSTEM = ("You are a careful assistant for a hardware store. Answer in one short sentence, name the aisle, "
          "and never invent products that the store does not sell.")
QUESTIONS = ["Where are the hammers?", "Do you sell paint?", "I need screws for wood."]
# measured here (fp32): mean |Δlogprob| 0.029 (int8) / 0.068 (fp8), top-1 agreement 100 % / 93 %; bf16 on the
# held-out text (docs/performance.md, "Quantized KV cache"): 0.048 / 0.080 and 96 % / 94 %. The bounds are
# about twice the measured error
BOUNDS = {"int8": (0.06, 0.9), "fp8_e4m3": (0.15, 0.85)}


def run(model, tok, prompts, **config):
    eng = LLMEngine(model, tok, EngineConfig(dtype=torch.float32, max_model_len=256, num_threads=1,
                                             kv_cache_memory_gib=0.1, **config))
    out: dict[str, list] = {}

    def drain(requests):
        for r in requests:
            eng.add_request(r)
        while eng.has_work():
            for c in eng.step():
                o = out.setdefault(c.request_id, [[], [], []])
                o[0].extend(c.token_ids)
                o[1].extend(lp.logprob for lp in c.logprobs)
                o[2].extend((lp.logprob, lp.top[0].token_id) for lp in c.prompt_logprobs)

    sp = engine_pb2.SamplingParams
    drain([engine_pb2.GenerateRequest(request_id="g0", prompt_token_ids=prompts[0],
                                      sampling=sp(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=True))])
    drain([engine_pb2.GenerateRequest(request_id=f"g{i}", prompt_token_ids=p,
                                      sampling=sp(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=True))
           for i, p in enumerate(prompts) if i])
    return eng, out, drain


@pytest.fixture(scope="module")
def case(smollm2_fp32, smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompts = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in QUESTIONS]
    _, ref, _ = run(smollm2_fp32, tok, prompts)
    return smollm2_fp32, tok, prompts, ref


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_quantized_cache_quality_against_auto_cache(case, kind):
    model, tok, prompts, ref = case
    # 32-token blocks (rows padded to 256 bytes) so the shared system prompt spans full blocks
    eng, out, drain = run(model, tok, prompts, kv_cache_dtype=kind, max_num_batched_tokens=32, block_size=32)
    assert eng.kv.prefix_stats.hits > 0 and eng.layout.quantized
    # teacher-forced: the reference continuations scored over the quantized cache
    sp = engine_pb2.SamplingParams
    drain([engine_pb2.GenerateRequest(request_id=f"t{i}", prompt_token_ids=p + ref[f"g{i}"][0],
                                      sampling=sp(temperature=0, max_tokens=1, prompt_logprobs=1))
           for i, p in enumerate(prompts)])
    deltas, same = [], 0
    for i, p in enumerate(prompts):
        scored = out[f"t{i}"][2][len(p) - 1:]  # entry j scores token j + 1 of the sequence
        tokens, lps = ref[f"g{i}"][0], ref[f"g{i}"][1]
        assert len(scored) == NEW
        deltas += [abs(s[0] - lp) for s, lp in zip(scored, lps, strict=True)]
        same += sum(s[1] == t for s, t in zip(scored, tokens, strict=True))
    mean_delta, top1 = sum(deltas) / len(deltas), same / len(deltas)
    max_delta, min_top1 = BOUNDS[kind]
    assert mean_delta < max_delta and top1 >= min_top1, (mean_delta, top1)
    # free-running greedy: the first tokens of every answer agree
    for i in range(len(prompts)):
        assert out[f"g{i}"][0][:2] == ref[f"g{i}"][0][:2]
    eng.close()
