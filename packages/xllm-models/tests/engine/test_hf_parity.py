"""Our engine on the real SmolLM2-135M-Instruct against Hugging Face transformers.

Oracle: teacher forcing. HF runs one plain forward over prompt + our output;
at every generated position its argmax must be our token and its log-softmax
of our token must match the logprob we reported. (HF ``generate`` with
``min_new_tokens`` would mask EOS and change the scores; ``ignore_eos`` does not.)
"""

from __future__ import annotations

import pytest
import torch

from xllm.kernels import native
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import unit_block_size
from xllm.testing.models import run_engine

pytestmark = pytest.mark.real_model

NEW_TOKENS = 32
LOGPROB_TOL = 1e-3  # fp32 vs fp32: we see ~1e-5

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue, and give one example of "
                                 "Rayleigh scattering in everyday life."}],
]
RAW = [
    "The",
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n    ",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. In 1969, "
    "the first humans",
]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    tok = smollm2_tokenizer
    ps = [tok.apply_chat_template(m) for m in CHATS] + [tok.encode(t) for t in RAW]
    assert len({len(p) for p in ps}) == len(ps)  # all lengths differ
    assert min(map(len, ps)) == 1 and max(map(len, ps)) > 40
    return ps


@torch.inference_mode()
def hf_teacher_forced(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF log-softmax rows predicting each of ``output``'s tokens: ``[len(output), vocab]``."""
    ids = torch.tensor([prompt + output[:-1]])
    return hf(ids).logits[0, len(prompt) - 1:].float().log_softmax(-1)


@pytest.fixture(scope="module")
def fp32_run(smollm2_fp32, smollm2_tokenizer, prompts):
    return run_engine(smollm2_fp32, smollm2_tokenizer, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def hf_rows(hf_smollm2_fp32, prompts, fp32_run):
    return {f"p{i}": hf_teacher_forced(hf_smollm2_fp32, p, fp32_run.tokens[f"p{i}"]) for i, p in enumerate(prompts)}


def check_against_hf(run, rows, prompts) -> float:
    """Assert token equality with HF's argmax and logprob closeness; return the max logprob diff."""
    worst = 0.0
    for i in range(len(prompts)):
        rid = f"p{i}"
        toks, lps = run.tokens[rid], run.logprobs[rid]
        assert len(toks) == len(lps) == NEW_TOKENS
        assert run.finish[rid] == engine_pb2.FINISH_REASON_LENGTH
        r = rows[rid]
        hf_greedy = r.argmax(-1).tolist()
        mismatch = next((j for j, (a, b) in enumerate(zip(toks, hf_greedy)) if a != b), None)
        assert mismatch is None, f"prompt {i}: token {mismatch} is {toks[mismatch]}, HF says {hf_greedy[mismatch]}"
        diff = (r[torch.arange(NEW_TOKENS), torch.tensor(toks)] - torch.tensor(lps)).abs().max().item()
        assert diff < LOGPROB_TOL, f"prompt {i}: logprob differs from HF by {diff}"
        worst = max(worst, diff)
    return worst


def test_fp32_greedy_equals_hf_token_for_token(fp32_run, hf_rows, prompts):
    worst = check_against_hf(fp32_run, hf_rows, prompts)
    print(f"fp32: max |logprob - HF| = {worst:.2e}")
    # all eight really ran together: one decode step carried every sequence
    assert max(s.num_decode_tokens for s in fp32_run.stats) == len(prompts)
    assert fp32_run.counters.max_batch_size == len(prompts)
    assert fp32_run.counters.num_preemptions == 0
    if native.unavailable_reason() is None:  # the prefills ran the fused general step
        assert fp32_run.mode_steps["native_step"] > 0 and fp32_run.mode_steps["eager"] == 0


def test_streamed_text_is_the_decoded_output(fp32_run, prompts, smollm2_tokenizer):
    for i in range(len(prompts)):
        rid = f"p{i}"
        assert fp32_run.text[rid] == smollm2_tokenizer.decode(fp32_run.tokens[rid])
        assert "\ufffd" not in fp32_run.text[rid]
    assert fp32_run.text["p1"].startswith("The capital of France is Paris")


@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "eager"])
def test_chunked_prefill_mixed_with_decodes_equals_hf(smollm2_fp32, smollm2_tokenizer, prompts, hf_rows, fused):
    run = run_engine(smollm2_fp32, smollm2_tokenizer, prompts, NEW_TOKENS, max_num_batched_tokens=7,
                     enable_prefix_cache=False,  # every token computed: no shared chat-template blocks
                     native_decode=fused)
    if fused and native.unavailable_reason() is None:
        assert run.mode_steps["native_step"] > 0 and run.mode_steps["eager"] == 0
    elif not fused:
        assert run.mode_steps["native_step"] == run.mode_steps["native"] == 0
    # hf_rows were computed on the unchunked outputs: up to a first divergence the contexts are
    # identical, so any divergence shows up as a token that is not HF's argmax.
    worst = check_against_hf(run, hf_rows, prompts)
    print(f"budget 7: max |logprob - HF| = {worst:.2e}")
    assert all(s.num_decode_tokens + s.num_prefill_tokens <= 7 for s in run.stats)
    assert any(s.num_decode_tokens and s.num_prefill_tokens for s in run.stats)  # chunks mixed with decodes
    # every prompt token and every fed-back output token was computed exactly once (no recompute)
    total = sum(s.num_decode_tokens + s.num_prefill_tokens for s in run.stats)
    assert total == sum(map(len, prompts)) + len(prompts) * (NEW_TOKENS - 1)
    assert len(run.stats) >= total // 7


def test_preemption_under_a_tiny_kv_pool_keeps_the_outputs(smollm2_fp32, smollm2_tokenizer, prompts,
                                                           fp32_run):
    """Greedy outputs are prefix-consistent, so 16-token runs must equal the first 16 tokens
    of the (HF-checked) 32-token run, however often the sequences were preempted and recomputed."""
    n = 16
    picked = [0, 4, 5, 6]  # prompt lengths 31, 1, 10 and 7 keep the recomputation cheap
    bs = unit_block_size(smollm2_fp32)  # 16 tokens in fp32
    per_block = smollm2_fp32.kv_cache_spec().bytes_per_token(torch.float32) * bs
    blocks = -(-(max(len(prompts[i]) for i in picked) + n) // bs) + 1  # the longest fits alone, not with all
    run = run_engine(smollm2_fp32, smollm2_tokenizer, [prompts[i] for i in picked], n,
                     kv_cache_memory_gib=blocks * per_block / 2**30, block_size=bs)
    assert run.counters.num_preemptions > 0
    for j, i in enumerate(picked):
        assert run.tokens[f"p{j}"] == fp32_run.tokens[f"p{i}"][:n], f"prompt {i}"
        diff = max(abs(a - b) for a, b in zip(run.logprobs[f"p{j}"], fp32_run.logprobs[f"p{i}"]))
        assert diff < LOGPROB_TOL


def test_request_joining_a_running_decode_batch(smollm2_fp32, smollm2_tokenizer, prompts, fp32_run):
    from xllm.core import EngineConfig, LLMEngine

    n = 16
    eng = LLMEngine(smollm2_fp32, smollm2_tokenizer, EngineConfig(dtype=torch.float32, max_model_len=512,
                                                                  max_num_seqs=4, num_threads=1))
    sampling = engine_pb2.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    out: dict[str, list[int]] = {"p1": [], "p5": []}

    def step():
        for c in eng.step():
            out[c.request_id].extend(c.token_ids)

    eng.add_request(engine_pb2.GenerateRequest(request_id="p1", prompt_token_ids=prompts[1], sampling=sampling))
    for _ in range(4):
        step()
    eng.add_request(engine_pb2.GenerateRequest(request_id="p5", prompt_token_ids=prompts[5], sampling=sampling))
    step()
    assert len(out["p1"]) == 5 and len(out["p5"]) == 1  # p5's prefill ran beside p1's decode
    while eng.has_work():
        step()
    assert eng.counters.multi_seq_decode_steps > 0
    assert out["p1"] == fp32_run.tokens["p1"][:n] and out["p5"] == fp32_run.tokens["p5"][:n]
