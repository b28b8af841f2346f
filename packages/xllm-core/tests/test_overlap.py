"""The runner's side of compute/communication overlap (xllm.core.overlap): the split of a packed step into two
parts by whole sequences, each attending through its own context, and the ``auto`` choice per step size.

Oracle for the split: the same step run plain (one context over every row) by the same runner, on the
xTensor and paged backends, through decodes, a speculative verify chunk and prefill chunks: the overlapped
step's logits equal it. The two-rank forward itself is tested in xllm-models (test_tensor_parallel_overlap)
and the engine's outputs in xllm-engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from xllm.core.kv import KVCacheLayout
from xllm.core.kv.paged import PagedKVCache
from xllm.core.kv.xtensor import XTensorKVCache
from xllm.core.model_runner import ModelRunner
from xllm.core.overlap import OverlapChooser, overlap_chooser, row_bucket, split_step
from xllm.core.sampling_params import SamplingParams
from xllm.core.sequence import Sequence
from xllm.engine_api.errors import ConfigError
from xllm.testing.tiny import TinyLM

CPU = torch.device("cpu")


def layout(spec, num_blocks=32, max_num_seqs=8, max_model_len=256, block_size=64) -> KVCacheLayout:
    return KVCacheLayout(spec, torch.float32, CPU, max_num_seqs, max_model_len, block_size, num_blocks, True)


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8), 0.0)


def decoding(kv, rid: str, tokens: list[int], new: int = 1) -> Sequence:
    """A sequence whose prompt is computed and whose next ``new`` rows have KV room."""
    s = seq(rid, tokens)
    assert kv.admit(s, len(tokens)) == len(tokens)
    s.output_ids.append(7)
    s.num_computed_tokens = len(tokens)
    assert kv.allocate(s, new)
    return s


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


class OverlapTiny(TinyLM):
    """TinyLM with an overlapped forward (each part through its own context, concatenated) and a fake cost:
    ``plain_s`` per plain forward, ``overlap_s`` per overlapped one, on ``clock``."""

    def __init__(self, clock: FakeClock, plain_s: float = 0.002, overlap_s: float = 0.001) -> None:
        super().__init__()
        self.clock, self.plain_s, self.overlap_s = clock, plain_s, overlap_s
        self.parts_seen: list[list[int]] = []

    def overlap_supported(self) -> bool:
        return True

    def forward(self, input_ids, positions, ctx):
        self.clock.now += self.plain_s
        return super().forward(input_ids, positions, ctx)

    def forward_overlapped(self, parts):
        self.clock.now += self.overlap_s
        self.parts_seen.append([len(p.input_ids) for p in parts])
        return torch.cat([TinyLM.forward(self, p.input_ids, p.positions, p.ctx) for p in parts])


def steps(runner: ModelRunner):
    """Three decodes, a verify chunk with two drafts and two prompt chunks; and the decodes alone."""
    kv = runner.kv
    d = [decoding(kv, f"d{i}", list(range(10 * i + 1, 10 * i + 8 + i))) for i in range(3)]
    v = decoding(kv, "v", list(range(40, 45)), new=3)
    p1, p2 = seq("p1", list(range(10, 40))), seq("p2", list(range(5, 25)))
    assert kv.admit(p1, 12) == 12 and kv.admit(p2, 20) == 20
    mixed = runner.prepare([*[(s, 1) for s in d], (v, 3), (p1, 12), (p2, 20)], {v: [3, 4]})
    return mixed, runner.prepare([(s, 1) for s in d])


@pytest.mark.parametrize("backend", [XTensorKVCache, PagedKVCache])
def test_an_overlapped_step_gives_the_plain_steps_logits(backend):
    clock = FakeClock()
    model = OverlapTiny(clock)
    kv = backend(layout(model.kv_cache_spec()))
    try:
        runner = ModelRunner(model, kv, CPU, native_decode=False)
        runner.set_overlap("on")
        for batch in steps(runner):
            assert runner.path(batch) == "overlap"
            want = runner.execute(batch, mode="eager")  # (stores the step's KV; the overlapped step stores the same)
            got = runner.execute(batch)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert runner.mode_steps["overlap"] == 2
        # by whole sequences, rows balanced: 3 decodes + 3 verify rows + 12 | 20 prompt rows; 1 | 2 decodes (the
        # first of the even cuts)
        assert model.parts_seen == [[18, 20], [1, 2]]
    finally:
        kv.close()


def test_split_cuts_between_whole_sequences():
    model = TinyLM()
    kv = XTensorKVCache(layout(model.kv_cache_spec()))
    try:
        runner = ModelRunner(model, kv, CPU, native_decode=False)
        mixed, decodes = steps(runner)
        a, b = split_step(mixed, mixed.input_ids)
        assert (a.num_decode, a.prefill_query_starts, b.num_decode, b.prefill_query_starts) == (3, [0, 3, 15], 0,
                                                                                                 [0, 20])
        assert a.prefill_context_lens == mixed.prefill_context_lens[:2]
        assert b.prefill_context_lens == mixed.prefill_context_lens[2:]
        assert torch.equal(torch.cat([a.input_ids, b.input_ids]), mixed.input_ids)
        assert torch.equal(torch.cat([a.address.token_slots, b.address.token_slots]), mixed.address.token_slots)
        a, b = split_step(decodes, decodes.input_ids)
        assert (a.num_decode, b.num_decode, b.prefill_query_starts) == (1, 2, [0])
        assert torch.equal(torch.cat([a.decode_context_lens, b.decode_context_lens]), decodes.decode_context_lens)
        one = runner.prepare([(decoding(kv, "x", [1, 2, 3]), 1)])
        assert split_step(one, one.input_ids) is None  # one sequence: nothing to split
        assert runner.path(one) == "eager"
    finally:
        kv.close()


def test_auto_keeps_the_faster_way_per_step_size_and_says_so(caplog):
    clock = FakeClock()
    model = OverlapTiny(clock, plain_s=0.002, overlap_s=0.001)  # overlapped: faster
    kv = XTensorKVCache(layout(model.kv_cache_spec()))
    try:
        runner = ModelRunner(model, kv, CPU, native_decode=False)
        runner.set_overlap("auto")
        runner.overlap.clock = clock
        _, decodes = steps(runner)
        with caplog.at_level(logging.INFO, logger="xllm.core.overlap"):
            seen = []
            for _ in range(8):
                seen.append(runner.path(decodes))
                runner.execute(decodes)
        assert seen == ["eager", "overlap"] * 3 + ["overlap", "overlap"]  # 3 trials each way, then kept
        assert runner.overlap.decisions == {4: ("overlap", pytest.approx(0.002), pytest.approx(0.001))}
        said = [r.getMessage() for r in caplog.records if "overlap" in r.getMessage()]
        assert len(said) == 1 and "steps of 3-4 rows: on" in said[0] and "plain 2.000 ms" in said[0]
    finally:
        kv.close()


def test_chooser_decides_per_bucket_with_a_fake_clock():
    c = OverlapChooser("auto", trials=2)
    assert c.choose(10) == "eager"
    for mode, s in [("eager", 1.0), ("overlap", 3.0), ("eager", 1.2), ("overlap", 0.5)]:
        assert c.choose(10) == mode
        c.record(10, mode, s)
    assert c.choose(10) == "eager" and c.choose(16) == "eager"  # medians 1.1 vs 1.75; one bucket (9-16)
    assert c.decisions[16][0] == "eager"
    for mode, s in [("eager", 2.0), ("overlap", 1.0), ("eager", 2.0), ("overlap", 1.0)]:
        c.record(100, mode, s)
    assert c.choose(65) == "overlap" and c.choose(10) == "eager"  # each step size its own decision
    c.record(100, "eager", 0.0)  # decided: later steps change nothing
    assert c.choose(100) == "overlap"
    assert OverlapChooser("on").choose(1) == "overlap"
    assert [row_bucket(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]


def test_overlap_modes_and_models():
    model = TinyLM()
    assert overlap_chooser("on", model) is None  # not a model that interleaves
    assert overlap_chooser("off", OverlapTiny(FakeClock())) is None
    assert overlap_chooser("auto", OverlapTiny(FakeClock())).mode == "auto"
    with pytest.raises(ConfigError, match="--tp-overlap"):
        overlap_chooser("sometimes", model)


def test_gloo_all_reduce_start_sums_and_a_closed_group_raises():
    from xllm.common.net import free_port
    from xllm.core.parallel.comm import CollectiveError, GlooComm, GroupAddress, Reduced, SingleRank

    comm = GlooComm(GroupAddress("127.0.0.1", free_port(), timeout_s=30), 0, 1)  # a group of one: the sum is x
    try:
        x = torch.arange(6, dtype=torch.float32)
        pending = comm.all_reduce_start(x)
        assert pending.wait() is x and torch.equal(x, torch.arange(6, dtype=torch.float32))
    finally:
        comm.close()
    with pytest.raises(CollectiveError, match="closed"):
        comm.all_reduce_start(x)
    done = SingleRank().all_reduce_start(x)
    assert isinstance(done, Reduced) and done.wait() is x
