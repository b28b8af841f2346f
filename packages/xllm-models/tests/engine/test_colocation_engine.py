"""Online/offline co-location in the engine (xllm.sched.colocation) on a tiny random Qwen3: offline
requests preempted by online ones (their batch full, or KV short) lose no tokens: greedy outputs equal
an uninterrupted run and HF's, seeded sampled outputs equal an uninterrupted run; the offline
counters and the starvation gauge are reported."""

from __future__ import annotations

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.engine_api.stats import StepStats
from xllm.models import load_model
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.models import IdTokenizer, save_random_hf_model, tiny_qwen3_config

pytest.importorskip("transformers")

NEW = 14


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    hf = save_random_hf_model(path, tiny_qwen3_config(), seed=5)
    g = torch.Generator().manual_seed(11)
    offline = [torch.randint(0, 997, (6 + 5 * i,), generator=g).tolist() for i in range(3)]
    online = [torch.randint(0, 997, (9 + 4 * i,), generator=g).tolist() for i in range(2)]
    return load_model(path, torch.float32, progress=False), hf, offline, online


def request(rid: str, prompt: list[int], offline: bool, **sampling) -> engine_pb2.GenerateRequest:
    sampling = {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True, "logprobs": True, **sampling}
    return engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, offline=offline,
                                      sampling=engine_pb2.SamplingParams(**sampling))


class Run:
    def __init__(self, model, async_scheduling: bool = False, **config) -> None:
        config = {"max_model_len": 256, "num_threads": 1, "dtype": torch.float32,
                  "async_scheduling": async_scheduling, **config}
        self.engine = LLMEngine(model, IdTokenizer(), EngineConfig(**config))
        self.stats: list[StepStats] = []
        self.engine.observers.append(self)
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[float]] = {}

    def on_step(self, stats: StepStats) -> None:
        self.stats.append(stats)

    def add(self, reqs) -> None:
        for r in reqs:
            self.engine.add_request(r)

    def step(self) -> None:
        for c in self.engine.step():
            self.tokens.setdefault(c.request_id, []).extend(c.token_ids)
            self.logprobs.setdefault(c.request_id, []).extend(lp.logprob for lp in c.logprobs)

    def finish(self) -> Run:
        for _ in range(5000):
            if not self.engine.has_work():
                return self
            self.step()
        raise AssertionError("the engine did not finish")


def offline_then_online(model, offline, online, async_scheduling=False, **sampling) -> Run:
    """Three offline requests fill a 3-sequence batch and decode; then two online requests arrive."""
    run = Run(model, async_scheduling, max_num_seqs=3)
    run.add(request(f"off{i}", p, True, seed=100 + i, **sampling) for i, p in enumerate(offline))
    while min((len(run.tokens.get(f"off{i}", [])) for i in range(3)), default=0) < 3:
        run.step()
    run.add(request(f"on{i}", p, False, seed=200 + i, **sampling) for i, p in enumerate(online))
    return run.finish()


def uninterrupted(model, offline, online, **sampling) -> Run:
    run = Run(model, max_num_seqs=8)
    run.add([*(request(f"off{i}", p, True, seed=100 + i, **sampling) for i, p in enumerate(offline)),
             *(request(f"on{i}", p, False, seed=200 + i, **sampling) for i, p in enumerate(online))])
    return run.finish()


@torch.inference_mode()
def assert_greedy_equals_hf(hf, prompts: dict[str, list[int]], run: Run) -> None:
    for rid, p in prompts.items():
        out = run.tokens[rid]
        assert len(out) == NEW
        rows = hf(torch.tensor([p + out[:-1]])).logits[0, len(p) - 1:].float().log_softmax(-1)
        assert out == rows.argmax(-1).tolist(), f"{rid} diverges from HF"
        diff = (rows[torch.arange(NEW), torch.tensor(out)] - torch.tensor(run.logprobs[rid])).abs().max().item()
        assert diff < 1e-3, f"{rid}: logprob differs from HF by {diff}"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_offline_preempted_for_a_full_batch_loses_no_tokens(qwen, async_scheduling):
    model, hf, offline, online = qwen
    run = offline_then_online(model, offline, online, async_scheduling)
    c = run.engine.counters
    assert c.offline_preemptions.get("batch_full", 0) >= 1  # online requests took offline sequences' slots
    assert c.offline_requests == 3 and c.offline_generation_tokens == 3 * NEW
    assert c.offline_prompt_tokens >= sum(map(len, offline))  # a preempted prompt's first token came once
    assert sum(s.offline.preempted.get("batch_full", 0) for s in run.stats) == c.offline_preemptions["batch_full"]
    expected = uninterrupted(model, offline, online)
    assert run.tokens == expected.tokens
    prompts = {f"off{i}": p for i, p in enumerate(offline)} | {f"on{i}": p for i, p in enumerate(online)}
    assert_greedy_equals_hf(hf, prompts, run)
    assert run.engine.kv.num_free_blocks == run.engine.layout.num_blocks
    assert run.engine.load_report().offline_longest_wait >= 0.0


def test_offline_preempted_with_seeded_sampling_loses_no_tokens(qwen):
    model, _, offline, online = qwen
    run = offline_then_online(model, offline, online, temperature=1.0)
    assert run.engine.counters.offline_preemptions.get("batch_full", 0) >= 1
    assert run.tokens == uninterrupted(model, offline, online, temperature=1.0).tokens


def test_online_requests_overtake_a_batch_full_of_offline_work(qwen):
    """Online requests finish before the offline ones they preempted (which a priority queue alone
    would leave running: the batch is full, KV is not short)."""
    model, _, offline, online = qwen
    run = Run(model, max_num_seqs=3)
    run.add(request(f"off{i}", p, True, max_tokens=60) for i, p in enumerate(offline))
    for _ in range(4):
        run.step()
    run.add(request(f"on{i}", p, False, max_tokens=4) for i, p in enumerate(online))
    # the load report's offline share (gateways route online requests on online load only)
    report = run.engine.load_report()
    assert (report.num_running, report.offline_running) == (3, 3)
    assert (report.num_waiting, report.offline_waiting) == (2, 0)
    sched = run.engine.scheduler
    total, offline_share = sched.pending_prefill_tokens()
    assert offline_share == 0 < total
    while any(len(run.tokens.get(f"on{i}", [])) < 4 for i in range(2)):
        run.step()
        assert not all(len(run.tokens.get(f"off{i}", [])) == 60 for i in range(3))
    run.finish()
    assert all(len(run.tokens[f"off{i}"]) == 60 for i in range(3))


def test_offline_preempted_for_kv_memory_loses_no_tokens(qwen):
    """A KV pool that the offline requests fill: online requests evict them (reason kv), never the reverse."""
    model, hf, offline, online = qwen
    probe = Run(model, max_num_seqs=8, kv_cache_backend="paged", block_size=16, enable_prefix_cache=False)
    layout = probe.engine.layout
    per_block = model.kv_cache_spec().bytes_per_token(torch.float32) * layout.block_size
    blocks = sum(layout.blocks_for(len(p) + NEW) for p in offline)  # the offline requests, whole, fill it
    run = Run(model, max_num_seqs=8, kv_cache_backend="paged", block_size=16, enable_prefix_cache=False,
              kv_cache_memory_gib=blocks * per_block / 2**30)
    assert run.engine.layout.num_blocks == blocks
    run.add(request(f"off{i}", p, True) for i, p in enumerate(offline))
    while min((len(run.tokens.get(f"off{i}", [])) for i in range(3)), default=0) < 2:
        run.step()
    run.add(request(f"on{i}", p, False) for i, p in enumerate(online))
    run.finish()
    c = run.engine.counters
    assert c.offline_preemptions.get("kv", 0) >= 1 and c.num_preemptions == sum(c.offline_preemptions.get(r, 0)
                                                                                for r in ("kv", "batch_full"))
    assert run.tokens == uninterrupted(model, offline, online).tokens
    prompts = {f"off{i}": p for i, p in enumerate(offline)} | {f"on{i}": p for i, p in enumerate(online)}
    assert_greedy_equals_hf(hf, prompts, run)
