"""Greedy outputs equal HF under every KV memory feature, for each KV backend (xLLM §4.3):
chunked prefill under a tiny token budget, prefix-cache hits (a shared system prompt), and
preemption in a pool too small for the batch. SmolLM2 (real weights) and tiny Qwen2/Qwen3."""

from __future__ import annotations

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.models import load_model
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import unit_block_size
from xllm.testing.models import IdTokenizer, save_random_hf_model, tiny_qwen3_config

transformers = pytest.importorskip("transformers")

NEW = 12
BACKENDS = ["xtensor", "paged"]
SYSTEM = ("You are a careful assistant for a hardware store. Answer in one short sentence, name the aisle, "
          "and never invent products that the store does not sell.")
QUESTIONS = ["Where are the hammers?", "Do you sell paint?", "I need screws for wood.", "What about garden hoses?"]


@torch.inference_mode()
def assert_greedy_equals_hf(hf, prompts: list[list[int]], tokens: dict[str, list[int]], logprobs: dict,
                            n: int = NEW) -> None:
    for i, p in enumerate(prompts):
        out = tokens[f"r{i}"]
        assert len(out) == n
        rows = hf(torch.tensor([p + out[:-1]])).logits[0, len(p) - 1:].float().log_softmax(-1)
        assert out == rows.argmax(-1).tolist(), f"prompt {i} diverges from HF"
        diff = (rows[torch.arange(n), torch.tensor(out)] - torch.tensor(logprobs[f"r{i}"])).abs().max().item()
        assert diff < 1e-3, f"prompt {i}: logprob differs from HF by {diff}"


def run(model, tokenizer, waves: list[list[list[int]]], n: int = NEW, **config):
    """Submit each wave after the previous one finished; returns tokens, logprobs, engine."""
    config.setdefault("max_model_len", 256)
    config.setdefault("num_threads", 1)
    config.setdefault("block_size", unit_block_size(model))
    eng = LLMEngine(model, tokenizer, EngineConfig(dtype=torch.float32, **config))
    tokens: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    k = 0
    for wave in waves:
        for p in wave:
            eng.add_request(engine_pb2.GenerateRequest(
                request_id=f"r{k}", prompt_token_ids=p,
                sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=True)))
            k += 1
        while eng.has_work():
            for c in eng.step():
                tokens.setdefault(c.request_id, []).extend(c.token_ids)
                lps.setdefault(c.request_id, []).extend(lp.logprob for lp in c.logprobs)
    return tokens, lps, eng


# ---- the models ------------------------------------------------------------------------------
def smollm2_case(request):
    tok = request.getfixturevalue("smollm2_tokenizer")
    prompts = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in QUESTIONS]
    return request.getfixturevalue("smollm2_fp32"), tok, request.getfixturevalue("hf_smollm2_fp32"), prompts


def qwen_case(name: str, path):
    if name == "qwen2":
        cfg = transformers.Qwen2Config(vocab_size=997, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                       tie_word_embeddings=True)
    else:
        cfg = tiny_qwen3_config()
    hf = save_random_hf_model(path, cfg, seed=3)
    model = load_model(path, torch.float32, progress=False)
    g = torch.Generator().manual_seed(7)
    system = torch.randint(0, 997, (70,), generator=g).tolist()
    prompts = [system + torch.randint(0, 997, (5 + 3 * i,), generator=g).tolist() for i in range(4)]
    return model, IdTokenizer(), hf, prompts


@pytest.fixture(scope="module", params=["smollm2", "qwen2", "qwen3"])
def case(request, tmp_path_factory):
    if request.param == "smollm2":
        return smollm2_case(request)
    return qwen_case(request.param, tmp_path_factory.mktemp(request.param))


# ---- the features ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_token_budget(case, backend):
    model, tok, hf, prompts = case
    tokens, lps, eng = run(model, tok, [prompts], kv_cache_backend=backend, max_num_batched_tokens=7,
                           enable_prefix_cache=False)
    assert eng.counters.steps > sum(len(p) for p in prompts) // 7  # prefill really was chunked
    assert_greedy_equals_hf(hf, prompts, tokens, lps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_cache_hits(case, backend):
    model, tok, hf, prompts = case
    tokens, lps, eng = run(model, tok, [prompts[:1], prompts[1:]], kv_cache_backend=backend)
    bs = eng.layout.block_size
    common = min(next(j for j, (a, b) in enumerate(zip(prompts[0], p)) if a != b) for p in prompts[1:])
    assert common >= 2 * bs  # the system prompt spans several blocks
    # each later prompt reused every full block of the shared system prompt
    assert eng.kv.prefix_stats.hits == 3 * (common // bs * bs)
    assert not eng.requests
    assert_greedy_equals_hf(hf, prompts, tokens, lps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_preemption(case, backend):
    model, tok, hf, prompts = case
    probe = LLMEngine(model, tok, EngineConfig(dtype=torch.float32, kv_cache_backend=backend, max_model_len=256,
                                               num_threads=1, block_size=unit_block_size(model)))
    bs = probe.layout.block_size
    n = bs + 4  # every sequence grows past a block boundary while decoding
    per_block = model.kv_cache_spec().bytes_per_token(torch.float32) * bs
    # every prompt is admitted at once and fills the pool; the first new block needed preempts
    blocks = max(sum(probe.layout.blocks_for(len(p)) for p in prompts),
                 probe.layout.blocks_for(max(len(p) for p in prompts) + n))
    tokens, lps, eng = run(model, tok, [prompts], n, kv_cache_backend=backend, enable_prefix_cache=False,
                           kv_cache_memory_gib=blocks * per_block / 2**30)
    assert eng.counters.num_preemptions > 0
    assert_greedy_equals_hf(hf, prompts, tokens, lps, n)
