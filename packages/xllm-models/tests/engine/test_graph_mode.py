"""Adaptive graph mode: a torch.compile'd decode graph gives the eager engine's greedy outputs
(a tiny random Llama checkpoint; the compiled bucket covers every batch size here because the
fused native path is switched off)."""

from __future__ import annotations

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.core.graph_runner import inductor_cache_dir
from xllm.models import load_model
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.models import save_random_hf_model

transformers = pytest.importorskip("transformers")


class IdTok:
    eos_token_ids = frozenset()

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def run(model, compile_decode: bool):
    eng = LLMEngine(model, IdTok(), EngineConfig(dtype=torch.float32, max_num_seqs=4, max_model_len=128,
                                                 num_threads=1, native_decode=False,
                                                 compile_decode=compile_decode))
    for i in range(4):
        eng.add_request(engine_pb2.GenerateRequest(
            request_id=f"r{i}", prompt_token_ids=[1 + (i * 7 + j) % 90 for j in range(5 + 3 * i)],
            sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)))
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    while eng.has_work():
        for c in eng.step():
            toks.setdefault(c.request_id, []).extend(c.token_ids)
            lps.setdefault(c.request_id, []).extend(x.logprob for x in c.logprobs)
    return toks, lps, eng.runner


@pytest.mark.slow
def test_compiled_decode_graph_equals_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))  # warm after the first run
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    save_random_hf_model(tmp_path / "m", cfg, seed=4)
    model = load_model(tmp_path / "m", torch.float32, progress=False)
    eager, eager_lp, _ = run(model, False)
    got, got_lp, runner = run(model, True)
    assert runner.graph is not None and runner.graph.covers(1)
    assert runner.mode_steps["compiled"] > 0
    assert got == eager
    assert max(abs(a - b) for r in eager_lp for a, b in zip(eager_lp[r], got_lp[r])) < 1e-4


def test_inductor_cache_lives_in_the_xllm_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XLLM_CACHE_DIR", str(tmp_path))
    assert inductor_cache_dir() == tmp_path / "inductor"
