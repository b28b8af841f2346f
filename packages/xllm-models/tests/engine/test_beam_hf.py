"""Beam search in the engine (xllm.core.beam) on the real SmolLM2-135M-Instruct against Hugging Face
``generate(num_beams=W, num_return_sequences=W)`` in fp32: the same hypotheses in the same order
with the same scores (widths 4 and 16; EOS endings, length penalty, early stopping), also while a
chat request decodes beside the search in the same forwards (its tokens HF's greedy ones)."""

from __future__ import annotations

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.kernels import native
from xllm.proto.engine.v1 import engine_pb2

pytestmark = pytest.mark.real_model

CASES = [  # (chat, width, max_new_tokens, length_penalty, early_stopping, a chat decoding beside the search)
    ("Hi", 4, 12, 1.0, False, "What is the capital of France?"),
    ("What is the capital of France?", 16, 8, 1.0, False, None),
    ("Name a colour.", 4, 16, 0.7, True, None),
]


@pytest.fixture(scope="module")
def engine(smollm2_fp32, smollm2_tokenizer):
    eng = LLMEngine(smollm2_fp32, smollm2_tokenizer, EngineConfig(dtype=torch.float32, max_model_len=256,
                                                                   max_num_seqs=4, num_threads=1,
                                                                   kv_cache_memory_gib=0.25))
    yield eng
    eng.close()


def _engine_beams(engine, prompt, width, max_tokens, length_penalty, early_stopping, beside=None):
    """The search's hypotheses (and the tokens of ``beside``, a greedy request decoding with it)."""
    es = {True: "true", False: "false"}[early_stopping]
    engine.add_request(engine_pb2.GenerateRequest(
        request_id="b", prompt_token_ids=prompt,
        sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, beam_width=width, length_penalty=length_penalty,
                                           early_stopping=es)))
    if beside is not None:
        engine.add_request(engine_pb2.GenerateRequest(
            request_id="g", prompt_token_ids=beside,
            sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    final, tokens = None, []
    while engine.has_work():
        for c in engine.step():
            if c.request_id == "g":
                tokens += c.token_ids
            elif c.finish_reason:
                final = c
    return final.beams, tokens


@pytest.mark.parametrize("chat,width,max_tokens,length_penalty,early_stopping,beside", CASES)
def test_beam_search_equals_hf_generate(engine, hf_smollm2_fp32, smollm2_tokenizer, chat, width, max_tokens,
                                        length_penalty, early_stopping, beside):
    prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": chat}])
    eos = sorted(smollm2_tokenizer.eos_token_ids)
    with torch.inference_mode():
        out = hf_smollm2_fp32.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens, do_sample=False,
            length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos, pad_token_id=eos[0],
            output_scores=True, return_dict_in_generate=True, temperature=None, top_p=None, top_k=None)
    hf_seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))  # EOS kept, padding cut
        hf_seqs.append(tuple(row[:end]))
    other = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": beside}]) if beside else None
    modes = dict(engine.runner.mode_steps)
    ours, tokens = _engine_beams(engine, prompt, width, max_tokens, length_penalty, early_stopping, other)
    if other is not None:  # its decode rows and the beams shared forwards; its tokens are HF's greedy ones
        assert engine.runner.mode_steps["beams"] - modes["beams"] >= len(tokens) - 2 >= 5
        with torch.inference_mode():
            greedy = hf_smollm2_fp32.generate(torch.tensor([other]), attention_mask=torch.ones(1, len(other),
                                              dtype=torch.long), max_new_tokens=max_tokens, do_sample=False,
                                              temperature=None, top_p=None, top_k=None, pad_token_id=eos[0])
        assert tokens == greedy[0, len(other):].tolist()
    assert [tuple(b.token_ids) for b in ours] == hf_seqs
    assert [b.score for b in ours] == pytest.approx(out.sequences_scores.tolist(), abs=2e-3)
    ended = [b.finish_reason == engine_pb2.FINISH_REASON_STOP for b in ours]
    assert ended == [s[-1] in eos for s in hf_seqs]


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="no fused native steps here (AVX-512)")
def test_a_large_step_runs_fused_then_the_beams_with_the_logits_of_one_shared_forward(engine, smollm2_tokenizer):
    """Beam rows ride in the step's one eager forward up to ``share_max_rows`` rows of the step's own;
    a larger step runs its own rows fused and the beams' forward after it: the same logits."""
    tok = smollm2_tokenizer
    engine.add_request(engine_pb2.GenerateRequest(request_id="b", prompt_token_ids=tok.encode("One, two, three"),
                                                  sampling=engine_pb2.SamplingParams(max_tokens=8, beam_width=4)))
    engine.add_request(engine_pb2.GenerateRequest(request_id="g", prompt_token_ids=tok.encode("Once upon a time"),
                                                  sampling=engine_pb2.SamplingParams(max_tokens=8, temperature=0.0)))
    while not engine.beams.groups:
        engine.step()
    runner = engine.runner
    plan = engine.scheduler.schedule()
    batch = runner.prepare([(c.seq, c.num_tokens) for c in plan.chunks])
    rows = engine.beams.begin().first
    modes = dict(runner.mode_steps)
    try:
        runner.share_max_rows = 0
        split = runner.execute(batch, extra=rows)
        runner.share_max_rows = 64
        shared = runner.execute(batch, extra=rows)
    finally:
        runner.share_max_rows = 64
        engine.abort("b"), engine.abort("g")
    assert runner.mode_steps["native"] - modes["native"] == 1 and runner.mode_steps["beams"] - modes["beams"] == 1
    assert split.shape == shared.shape == (1 + rows.num_rows, engine.model.vocab_size)
    assert torch.allclose(split, shared, atol=2e-3, rtol=1e-4), (split - shared).abs().max()
