"""Adaptive graph mode: a torch.compile'd decode graph gives the eager engine's greedy outputs."""

from __future__ import annotations

import pytest

from xllm.core.graph_runner import inductor_cache_dir


@pytest.mark.slow
def test_compiled_decode_graph_equals_eager(kit, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    ps = [[1 + (i * 7 + j) % 40 for j in range(5 + 3 * i)] for i in range(4)]

    def reqs():
        return [kit.request(f"r{i}", p, max_tokens=12, ignore_eos=True, logprobs=True) for i, p in enumerate(ps)]

    eager = kit.engine(tiny_model, max_num_seqs=4)
    expected = kit.generate(eager, reqs())
    compiled = kit.engine(tiny_model, max_num_seqs=4, compile_decode=True)
    assert compiled.runner.graph is not None and compiled.runner.graph.covers(1)
    got = kit.generate(compiled, reqs())
    assert compiled.runner.mode_steps["compiled"] > 0
    assert got.tokens == expected.tokens
    assert max(abs(a - b) for r in expected.logprobs for a, b in zip(got.logprobs[r], expected.logprobs[r])) < 1e-4


def test_inductor_cache_lives_in_the_xllm_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XLLM_CACHE_DIR", str(tmp_path))
    assert inductor_cache_dir() == tmp_path / "inductor"
