"""Speculative verify chunks through the fused decode kernel (``ModelRunner`` mode ``native_verify``):
a chunk's k+1 rows share its slot at consecutive positions and the kernel attends them causally, one
row after another. Held to the general step and to the eager module path on the same packed step
(fp32 and bf16; Llama, Qwen3 q/k norm), and end to end: greedy outputs with prompt lookup equal
plain decoding while the verify steps take the decode kernel."""

from __future__ import annotations

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.kernels import native
from xllm.models import load_model
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.models import IdTokenizer, save_random_hf_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None, reason="native kernels unavailable")

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    if request.param == "llama":
        cfg = transformers.LlamaConfig(**COMMON)
    else:
        cfg = transformers.Qwen3Config(**{**COMMON, "head_dim": 32}, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp(f"verify-{request.param}")
    save_random_hf_model(path, cfg, seed=9, std=0.1)
    return path


def _engine(model, **config):
    return LLMEngine(model, IdTokenizer(), EngineConfig(dtype=model.dtype, num_threads=2, max_model_len=256,
                                                        **config))


def _prefilled(model, prompts):
    """An engine whose sequences have their prompts in KV (one prefill step each) and a first token."""
    eng = _engine(model)
    for i, p in enumerate(prompts):
        eng.add_request(engine_pb2.GenerateRequest(request_id=f"r{i}", prompt_token_ids=p,
                                                   sampling=engine_pb2.SamplingParams(max_tokens=50, temperature=0)))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    return eng


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_chunks_through_decode_kernel_match_other_paths(model_dir, dtype):
    """One plain decode row plus two verify chunks (3 and 4 rows): the decode kernel's logits against
    the general step's and the eager path's on the same packed step (each path writes the same KV rows)."""
    model = load_model(model_dir, dtype)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (17, 30, 9)]
    eng = _prefilled(model, prompts)
    seqs = sorted(eng.scheduler.running, key=lambda s: s.request_id)
    drafts = {seqs[1]: [5, 6], seqs[2]: [7, 8, 9]}
    chunks = [(seqs[0], 1)] + [(s, 1 + len(d)) for s, d in drafts.items()]
    for seq, n in chunks:  # KV room for the rows (the scheduler and the speculator reserve it in a real step)
        assert eng.kv.allocate(seq, n)
    runner = eng.runner
    batch = runner.prepare(chunks, drafts)
    assert runner._skinny_verify(batch)
    logits = {}
    with torch.inference_mode():
        logits["decode kernel"] = runner.execute(batch)
        assert runner.mode_steps["native_verify"] == 1
        logits["general step"] = runner.model.compute_logits(runner.fused.step(runner.step_tokens(batch), runner.kv))
        hidden = runner.model.forward(batch.input_ids, batch.positions, runner.kv.addressing.context(batch))
        logits["eager"] = runner.model.compute_logits(hidden[batch.logit_rows])
    assert logits["decode kernel"].shape == (1 + 3 + 4, 300)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    for name in ("general step", "eager"):
        diff = (logits["decode kernel"] - logits[name]).abs().max().item()
        assert diff < tol * max(1.0, logits[name].abs().max().item()), (name, diff)
    eng.close()


def test_greedy_lookup_identical_through_decode_kernel(model_dir):
    model = load_model(model_dir, torch.float32)
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 300, (10,), generator=g).tolist()
    prompts = [base * 4, torch.randint(0, 300, (15,), generator=g).tolist()]

    def run(**config):
        eng = _engine(model, **config)
        for i, p in enumerate(prompts):
            eng.add_request(engine_pb2.GenerateRequest(
                request_id=f"r{i}", prompt_token_ids=p,
                sampling=engine_pb2.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))
        toks: dict[str, list[int]] = {}
        while eng.has_work():
            for c in eng.step():
                toks.setdefault(c.request_id, []).extend(c.token_ids)
        modes = dict(eng.runner.mode_steps)
        eng.close()
        return toks, modes

    want, _ = run()
    got, modes = run(speculative="ngram", num_speculative_tokens=3)
    assert got == want
    assert modes["native_verify"] > 0
