"""Expert parallelism over two ranks (``--tensor-parallel-size 2 --enable-expert-parallel``): each rank holds whole
routed experts (with redundant replicas), attention stays tensor-parallel, and EPLB switches the placement at run
time (:mod:`xllm.models.expert_parallel`, :mod:`xllm.core.eplb`).

Oracles: the one-process engine (TP=1) of the same weights, token for token for greedy and seeded sampling
requests, and Hugging Face ``generate`` for the greedy ones. Models: tiny random Qwen3-MoE, DeepSeek-V2 (shared
experts) and DeepSeek-V3 (sigmoid routing, correction bias, group-limited top-k) as transformers saves them. The
DeepSeek-V3 model's correction bias is skewed so every token picks experts 0, 1 and 2: the default placement puts
that load on one rank, and EPLB (a window of 4 steps) must switch mid-stream to a placement that evens it out
without changing a token. Qwen3-MoE is forced (the test hook) to a permuted placement mid-stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from safetensors.torch import load_file, save_file

from xllm.core.config import EngineConfig
from xllm.engine.loader import LoadedEngine, load_engine
from xllm.engine_api.stats import ExpertBalance, StepStats
from xllm.models import resolve_model
from xllm.sched.eplb import Placement
from xllm.testing.engine import Collected, drive_loaded, make_request
from xllm.testing.models import save_tp_arch_model
from xllm.testing.reference import hf_greedy_tokens

transformers = pytest.importorskip("transformers")

ARCHS = ("qwen3_moe", "deepseek_v2", "deepseek_v3")
HOT = (0, 1, 2)  # the experts the skewed DeepSeek-V3 router always picks (groups 0 and 1 of 4)


def config(tp: int, ep: bool, **kw) -> EngineConfig:
    return EngineConfig(dtype=torch.float32, quantization="none", kv_cache_backend="xtensor", max_num_seqs=8,
                        max_num_batched_tokens=48, kv_cache_memory_gib=0.05, max_model_len=512, num_threads=1,
                        tensor_parallel_size=tp, enable_expert_parallel=ep, **kw)


def workload():
    reqs = [make_request(f"greedy{i}", [100 + 13 * i + j for j in range(20 + 7 * i)], max_tokens=24, ignore_eos=True)
            for i in range(3)]
    reqs += [make_request(f"sampled{i}", [700 + 5 * i + j for j in range(30)], temperature=0.9, top_p=0.95,
                          seed=5 + i, max_tokens=24, ignore_eos=True) for i in range(3)]
    return reqs


@dataclass
class Windows:
    """Every load window the engine closed (a step observer)."""

    reports: list[ExpertBalance] = field(default_factory=list)

    def on_step(self, s: StepStats) -> None:
        if s.experts is not None:
            self.reports.append(s.experts)


@dataclass
class Run:
    got: Collected
    windows: list[ExpertBalance]
    rebalances: int = 0
    switch_steps: list[int] = field(default_factory=list)
    steps: int = 0
    w13_shape: tuple = ()


def serve(path, name: str, cfg: EngineConfig, force=None) -> Run:
    windows = Windows()
    loaded: LoadedEngine = load_engine(str(path), name, cfg, f"{name}-tp{cfg.tensor_parallel_size}", progress=False,
                                       observers=[windows])
    engine = loaded.engine
    try:
        eplb = getattr(engine.runner, "eplb", None)
        if force is not None:
            eplb.request(force(eplb.plane.placement))
        got = drive_loaded(loaded, workload())
        run = Run(got, windows.reports)
        if eplb is not None:
            run.rebalances, run.switch_steps, run.steps = eplb.rebalances, eplb.switch_steps, eplb.steps
            run.w13_shape = tuple(eplb.plane.modules[0].w13.shape)
        return run
    finally:
        engine.close()
        loaded.compute.shutdown()


def skew(path) -> None:
    """Every DeepSeek-V3 MoE layer's correction bias raised on :data:`HOT` (choice only: weights unbiased)."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            t.zero_()
            t[list(HOT)] = 10.0
    save_file(tensors, file, metadata={"format": "pt"})


def reversed_placement(p: Placement) -> Placement:
    """Every layer's slots in reverse order: each rank holds the other's experts."""
    return Placement(p.experts, p.ranks, p.slots, tuple(tuple(reversed(layer)) for layer in p.layers))


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory):
    name = request.param
    path = save_tp_arch_model(tmp_path_factory.mktemp("ep") / name, name, resolve_model(None, progress=False))
    if name == "deepseek_v3":
        skew(path)
    one = serve(path, name, config(1, False))
    if name == "deepseek_v3":  # automatic EPLB on the skewed load
        two = serve(path, name, config(2, True, num_redundant_experts=2, enable_eplb=True, eplb_step_interval=4))
    elif name == "qwen3_moe":  # a forced switch to a permuted placement
        two = serve(path, name, config(2, True, eplb_step_interval=4), force=reversed_placement)
    else:
        two = serve(path, name, config(2, True, num_redundant_experts=2))
    return name, path, one, two


def test_expert_parallel_generates_what_one_process_does(arch):
    name, _, one, two = arch
    reqs = workload()
    assert set(two.got.final) == {r.request_id for r in reqs}
    for r in reqs:
        assert len(two.got.tokens[r.request_id]) == 24
        assert two.got.tokens[r.request_id] == one.got.tokens[r.request_id], (name, r.request_id)
        assert two.got.final[r.request_id].finish_reason == one.got.final[r.request_id].finish_reason


def test_each_rank_holds_whole_experts(arch):
    name, path, _, two = arch
    cfg = transformers.AutoConfig.from_pretrained(path)
    experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    slots = -(-(experts + (0 if name == "qwen3_moe" else 2)) // 2)
    # whole experts (all moe_intermediate_size channels), as many as the slots: not a channel slice of every expert
    assert two.w13_shape == (slots, 2 * cfg.moe_intermediate_size, cfg.hidden_size)


def test_greedy_tokens_match_hugging_face(arch):
    _, path, _, two = arch
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for r in workload()[:2]:
        assert two.got.tokens[r.request_id] == hf_greedy_tokens(hf, list(r.prompt_token_ids), 24), r.request_id


def test_placement_switches_mid_stream(arch):
    name, _, _, two = arch
    if name == "deepseek_v2":
        assert two.rebalances == 0 and not two.windows  # no EPLB, default interval: no window closed
        return
    assert two.rebalances >= 1, "no placement switch"
    assert 0 < two.switch_steps[0] < two.steps - 4, two.switch_steps  # mid-stream: steps ran before and after it
    if name == "deepseek_v3":
        first, last = two.windows[0], two.windows[-1]
        assert first.imbalance > 1.3, first  # the hot experts' load on one rank
        assert last.imbalance < first.imbalance and last.imbalance <= 1.2, [w.imbalance for w in two.windows]
        assert sum(first.tokens[e] for e in HOT) == sum(first.tokens)


def test_a_killed_expert_rank_fails_the_instance_within_seconds(tmp_path):
    """SIGKILL of the worker rank of an expert-parallel instance (EPLB on, load windows of 4 steps) while a stream
    decodes: rank 0's next all-to-all fails the whole instance at once (``RankFailed``),
    never a hung one; the gateway then resumes its streams elsewhere as for any crashed instance
    (``integration_tests/test_cluster_tp.py`` shows that path for a killed tensor-parallel rank)."""
    import os
    import signal

    from xllm.core.async_engine import AsyncEngine
    from xllm.testing.engine import stream_until_killed

    path = save_tp_arch_model(tmp_path / "qwen3_moe", "qwen3_moe", resolve_model(None, progress=False))
    loaded = load_engine(str(path), "qwen3_moe", config(2, True, enable_eplb=True, eplb_step_interval=4),
                         "ep-kill", progress=False)
    worker = loaded.engine.runner.group.processes[0]
    aeng = AsyncEngine(loaded.engine, compute=loaded.compute)
    aeng.start()
    try:
        n, err, after = stream_until_killed(aeng, list(range(100, 140)), lambda: os.kill(worker.pid, signal.SIGKILL))
        assert err is not None and n < 400, "the stream did not fail"
        assert after < 10
        assert aeng.crashed and "RankFailed" in (aeng.dead_reason or "")
    finally:
        aeng.shutdown(5)
        loaded.engine.close()
        loaded.compute.shutdown()
    assert worker.exitcode == -signal.SIGKILL
