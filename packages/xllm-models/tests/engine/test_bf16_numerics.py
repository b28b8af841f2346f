"""The production configuration (bf16 weights, native kernels, xTensor KV, the fused decode step)
held to numbers against HF transformers in fp32, with the bound taken from HF's own bf16.

bf16 is not token-equal to fp32 over long outputs, so "close to fp32" needs a yardstick: HF's bf16
forward of the same weights, teacher-forced over the same positions. Over a few hundred positions
of our greedy bf16 decode, we require

- top-1 agreement with HF fp32 (our token is fp32's argmax) at least HF bf16's, less 2% of positions;
- the error of our log-prob of each chosen token against HF fp32's within 1.2x HF bf16's own
  (mean), 1.4x (95th percentile) and 2x (largest). Measured over the GEMM choices a machine can
  make (oneDNN, native, or per shape): mean 0.98-1.11x, 95th percentile 1.03-1.23x, largest
  1.13-1.38x. The tail bounds are on the 95th percentile and the maximum because a 99th percentile
  of 320 positions is the third-largest value: it moved from 1.01x to 1.47x HF bf16's when the
  measured per-shape GEMM choice (gemm_choice) changed which rounding the prefill took.

And batched decode must produce the text each request gets alone (content, not just lengths): up to a
first difference, which may only fall where the alone run's top two tokens were a near-tie at bf16's
resolution.
"""

from __future__ import annotations

import copy

import pytest
import torch

from xllm.kernels import native
from xllm.testing.models import run_engine

pytestmark = pytest.mark.real_model

NEW_TOKENS = 40
BF16_TIE = 0.25 + 1e-5  # two bf16 steps of a logit in [16, 32) (+ the fp32 rounding of the log-softmax)
TEXTS = [
    "The history of the printing press begins",
    "def quicksort(items):\n    ",
    "Photosynthesis is the process by which",
    "Ingredients for a simple bread: flour,",
    "In 1969, the first humans",
    "The three laws of motion state that",
    "Dear customer, thank you for your order.",
    "A haiku about autumn rain:\n",
]
CHAT = ["What is the capital of Japan?", "Give me three tips for learning to cook.",
        "Why do cats purr?", "Explain recursion to a child."]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    tok = smollm2_tokenizer
    return [tok.encode(t) for t in TEXTS] + [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_dir):
    from xllm.models import load_model

    return load_model(smollm2_dir, torch.bfloat16, progress=False)


@pytest.fixture(scope="module")
def hf_bf16(hf_smollm2_fp32):
    return copy.deepcopy(hf_smollm2_fp32).to(torch.bfloat16)


@torch.inference_mode()
def rows(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF log-softmax (fp32) rows predicting each of ``output``'s tokens."""
    logits = hf(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1:]
    return logits.float().log_softmax(-1)


NEEDS_FUSED = pytest.mark.skipif(native.unavailable_reason() is not None, reason="no fused native steps here (AVX-512)")


@pytest.mark.parametrize("native_decode", [pytest.param(True, marks=NEEDS_FUSED), False], ids=["fused", "modules"])
def test_bf16_decode_is_as_close_to_hf_fp32_as_hf_bf16_is(smollm2_bf16, smollm2_tokenizer, hf_smollm2_fp32,
                                                          hf_bf16, prompts, native_decode):
    """Eight at once: every decode step takes the fused native step, or (``modules``) the eager
    modules with the native skinny GEMMs and decode attention. A 5% error in the attention scale of
    the fused step raised the mean error from 0.96x to 1.38x HF bf16's: the bound is 1.2x."""
    batch = prompts[:8]
    run = run_engine(smollm2_bf16, smollm2_tokenizer, batch, NEW_TOKENS, dtype=torch.bfloat16,
                     native_decode=native_decode)
    assert sum(s.num_decode_tokens for s in run.stats) == len(batch) * (NEW_TOKENS - 1)
    assert run.native_decode_steps == (NEW_TOKENS - 1 if native_decode else 0)
    ours_agree = hf_agree = 0
    ours_err, hf_err = [], []
    for i, p in enumerate(batch):
        toks, lps = run.tokens[f"p{i}"], torch.tensor(run.logprobs[f"p{i}"])
        ref, half = rows(hf_smollm2_fp32, p, toks), rows(hf_bf16, p, toks)
        pick = torch.arange(len(toks)), torch.tensor(toks)
        ours_agree += int((ref.argmax(-1) == torch.tensor(toks)).sum())
        hf_agree += int((half.argmax(-1) == ref.argmax(-1)).sum())
        ours_err.append((lps - ref[pick]).abs())
        hf_err.append((half[pick] - ref[pick]).abs())
    n = len(batch) * NEW_TOKENS
    ours_err_t, hf_err_t = torch.cat(ours_err), torch.cat(hf_err)
    figures = {
        "positions": n, "top-1 = HF fp32 (ours)": ours_agree, "top-1 = HF fp32 (HF bf16)": hf_agree,
        "mean |dlogprob| ours": float(ours_err_t.mean()), "mean |dlogprob| HF bf16": float(hf_err_t.mean()),
        "p95 |dlogprob| ours": float(ours_err_t.quantile(0.95)),
        "p95 |dlogprob| HF bf16": float(hf_err_t.quantile(0.95)),
        "max |dlogprob| ours": float(ours_err_t.max()), "max |dlogprob| HF bf16": float(hf_err_t.max()),
    }
    print(figures)
    assert ours_agree >= hf_agree - 0.02 * n, figures
    assert figures["mean |dlogprob| ours"] <= 1.2 * figures["mean |dlogprob| HF bf16"], figures
    assert figures["p95 |dlogprob| ours"] <= 1.4 * figures["p95 |dlogprob| HF bf16"], figures
    assert figures["max |dlogprob| ours"] <= 2.0 * figures["max |dlogprob| HF bf16"], figures


@pytest.fixture(scope="module")
def alone_runs(smollm2_bf16, smollm2_tokenizer, prompts):
    """Prompt ``i`` run by itself (with the top five log-probs of every position: a near-tie may be three-way),
    run once on first use."""
    runs = {}

    def alone(i: int):
        if i not in runs:
            runs[i] = run_engine(smollm2_bf16, smollm2_tokenizer, [prompts[i]], NEW_TOKENS, dtype=torch.bfloat16,
                                 top_logprobs=5)
        return runs[i]
    return alone


# (the ids name the AVX-512 machine's steps; without them both sizes run the same eager modules)
@pytest.mark.parametrize("size", [8, pytest.param(12, marks=NEEDS_FUSED)], ids=["fused", "general-step"])
def test_batched_decode_produces_what_each_request_gets_alone(smollm2_bf16, smollm2_tokenizer, prompts,
                                                              alone_runs, size):
    """Eight at once (the fused decode step) and twelve (the fused general step while more than eight
    run: the blocked GEMM instead of the row-streaming one) against each prompt alone, by content; the
    same batch without logprobs (every step's tokens from the greedy LM head, no logits) gives the same
    tokens as with them (the logits and the sampler)."""
    batched = run_engine(smollm2_bf16, smollm2_tokenizer, prompts[:size], NEW_TOKENS, dtype=torch.bfloat16)
    plain = run_engine(smollm2_bf16, smollm2_tokenizer, prompts[:size], NEW_TOKENS, dtype=torch.bfloat16,
                       logprobs=False)
    assert batched.greedy_head_steps == 0 and plain.greedy_head_steps > 0
    assert plain.tokens == batched.tokens and plain.finish == batched.finish
    if native.unavailable_reason() is None:  # (else every step is eager: the same invariance below)
        assert (batched.native_decode_steps > 0) == (size <= 8)
        assert batched.mode_steps["eager"] == 0
    parted = 0
    for i in range(size):
        alone = alone_runs(i)
        a, b = alone.tokens["p0"], batched.tokens[f"p{i}"]
        assert len(b) == NEW_TOKENS and batched.finish[f"p{i}"] == alone.finish["p0"]
        if a == b:
            assert batched.text[f"p{i}"] == alone.text["p0"]
            continue
        j = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        # where they part, the alone run must have rated the batched run's token (nearly) as high as its
        # own: within two bf16 steps of a logit below 32 (the LM head's output is bf16, 0.125 apart there)
        top = alone.top["p0"][j]
        assert b[j] in top and top[a[j]] - top[b[j]] <= BF16_TIE, f"prompt {i} parts at token {j}: {b[j]}, {top}"
        parted += 1
    print(f"{parted} of {size} batched outputs part from the alone run, each at a near-tie")
