"""Tensor parallelism's executor pieces (xllm.core.executor): the step-plan codec round trip, the path
choice workers check against rank 0's, the start-up agreement on paths, the plan channel, and the
xTensor mirror (a worker's backend applying rank 0's mappings shows the same pages at the same slot
positions)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from xllm.core.executor.channel import SETUP, SHUTDOWN, STEP, PlanChannel, RankFailed
from xllm.core.executor.group import _CappedFused, agree_capabilities
from xllm.core.executor.plan import decode_step, encode_step
from xllm.core.kv import KVCacheLayout
from xllm.core.kv.addressing import PageAddress, SlotAddress
from xllm.core.kv.paged import PagedKVCache
from xllm.core.kv.xtensor import XTensorKVCache
from xllm.core.model_runner import BatchInputs, ModelRunner
from xllm.core.sampling_params import SamplingParams
from xllm.core.sequence import PromptLogprobs, Sequence
from xllm.testing.tiny import TinyLM

CPU = torch.device("cpu")


def layout(spec, num_blocks=16, max_num_seqs=4, max_model_len=256, block_size=64) -> KVCacheLayout:
    return KVCacheLayout(spec, torch.float32, CPU, max_num_seqs, max_model_len, block_size, num_blocks, True)


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8), 0.0)


def decoding(kv, rid: str, tokens: list[int], new: int = 1) -> Sequence:
    """A sequence whose prompt is computed and whose next ``new`` rows have KV room."""
    s = seq(rid, tokens)
    assert kv.admit(s, len(tokens)) == len(tokens)
    s.num_computed_tokens = len(tokens)
    s.output_ids.append(7)
    s.num_computed_tokens = len(tokens)
    assert kv.allocate(s, new)
    return s


def mixed_batch(runner: ModelRunner) -> BatchInputs:
    """Two decodes, a verify chunk with two drafts, and a prompt chunk with prompt logprobs."""
    kv = runner.kv
    d1, d2 = decoding(kv, "d1", list(range(1, 11))), decoding(kv, "d2", list(range(20, 37)))
    v = decoding(kv, "v", list(range(40, 45)), new=3)
    p = seq("p", list(range(10, 40)))  # (TinyLM: 63 tokens)
    p.prompt_logprobs = PromptLogprobs()
    assert kv.admit(p, 12) == 12
    return runner.prepare([(d1, 1), (d2, 1), (v, 3), (p, 12)], {v: [3, 4]})


def assert_same(a: BatchInputs, b: BatchInputs) -> None:
    for name in ("input_ids", "positions", "decode_context_lens", "sample_rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("num_decode", "prefill_query_starts", "prefill_context_lens", "prompt_rows", "spec_rows"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("sample_seqs", "prompt_spans", "spec_spans", "chunks"):
        assert len(getattr(a, name)) == len(getattr(b, name)), name
    assert torch.equal(a.logit_rows, b.logit_rows) and a.num_prefill_seqs == b.num_prefill_seqs
    assert type(a.address) is type(b.address)
    if isinstance(a.address, SlotAddress):
        assert torch.equal(a.address.token_slots, b.address.token_slots)
        assert torch.equal(a.address.decode_slots, b.address.decode_slots)
        assert a.address.prefill_slots == b.address.prefill_slots
    else:
        assert torch.equal(a.address.slot_mapping, b.address.slot_mapping)
        assert torch.equal(a.address.decode_block_tables, b.address.decode_block_tables)
        assert len(a.address.prefill_block_tables) == len(b.address.prefill_block_tables)
        for x, y in zip(a.address.prefill_block_tables, b.address.prefill_block_tables, strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("backend", [XTensorKVCache, PagedKVCache])
def test_step_plan_round_trip_keeps_every_field(backend):
    model = TinyLM()
    kv = backend(layout(model.kv_cache_spec()))
    try:
        runner = ModelRunner(model, kv, CPU)
        batch = mixed_batch(runner)
        assert batch.spec_spans and batch.prompt_rows and batch.num_decode == 2  # every kind of row is there
        ops = np.array([[0, 1, 5, 2], [1, 0, -1, 1]], dtype=np.int64)
        words = encode_step(batch, "native_step", True, ops)
        msg = decode_step(np.frombuffer(words.tobytes(), dtype=np.int64), CPU)
        assert_same(batch, msg.batch)
        assert (msg.mode, msg.greedy) == ("native_step", True) and np.array_equal(msg.kv_ops, ops)
        # a decoded plan is what the worker's runner executes: the same logits as rank 0's batch
        assert torch.equal(runner.execute(msg.batch), runner.execute(batch))
        with pytest.raises(ValueError, match=r"truncated|left over"):
            decode_step(words[:-1], CPU)
    finally:
        kv.close()


def test_paged_plan_without_decodes_has_no_block_table():
    model = TinyLM()
    kv = PagedKVCache(layout(model.kv_cache_spec()))
    p = seq("p", list(range(30)))
    assert kv.admit(p, 30) == 30
    batch = ModelRunner(model, kv, CPU).prepare([(p, 30)])
    assert batch.address.decode_block_tables is None
    msg = decode_step(encode_step(batch, "eager", False), CPU)
    assert isinstance(msg.batch.address, PageAddress) and msg.batch.address.decode_block_tables is None
    assert torch.equal(msg.batch.address.prefill_block_tables[0], batch.address.prefill_block_tables[0])


class FakeFused:
    """A fused forward that records nothing but its limits (the path choice is what is tested)."""

    def __init__(self, hidden: int, max_batch: int, max_step_tokens: int) -> None:
        self.hidden, self.max_batch, self.max_step_tokens = hidden, max_batch, max_step_tokens

    def supports(self, kv) -> bool:
        return True

    def __call__(self, input_ids, positions, slots, kv):
        return torch.zeros(len(input_ids), self.hidden)

    def step(self, tokens, kv):
        return torch.zeros(len(tokens.sample_rows), self.hidden)


def test_path_is_the_one_execute_takes():
    model = TinyLM()
    kv = XTensorKVCache(layout(model.kv_cache_spec(), num_blocks=32, max_num_seqs=8))
    try:
        runner = ModelRunner(model, kv, CPU)
        decodes = [decoding(kv, f"d{i}", list(range(10 * i + 1, 10 * i + 6))) for i in range(5)]
        v = decoding(kv, "v", list(range(50, 55)), new=3)
        p = seq("p", list(range(30, 50)))
        assert kv.admit(p, 20) == 20
        batches = [runner.prepare([(decodes[0], 1)]), runner.prepare([(d, 1) for d in decodes]),
                   runner.prepare([(decodes[0], 1), (v, 3)], {v: [1, 2]}), runner.prepare([(p, 6)]),
                   runner.prepare([(decodes[0], 1), (p, 20)])]
        for fused in (None, FakeFused(32, max_batch=4, max_step_tokens=8)):
            runner.fused = fused
            for batch in batches:
                before = dict(runner.mode_steps)
                mode = runner.path(batch)
                runner.execute(batch)
                assert {k for k in runner.mode_steps if runner.mode_steps[k] != before[k]} == {mode}
        seen = [runner.path(b) for b in batches]
        assert seen == ["native", "native_step", "native_verify", "native_step", "eager"]
    finally:
        kv.close()


class RowsComm:
    """A communicator whose other rank reports ``other``."""

    rank, size = 0, 2

    def __init__(self, other: list[float]) -> None:
        self.other = torch.tensor(other, dtype=torch.float32)

    def all_gather(self, x):
        return [x, self.other]


def test_ranks_agree_on_the_fused_paths_and_the_kv_layout():
    model = TinyLM()
    kv = XTensorKVCache(layout(model.kv_cache_spec()))
    try:
        runner = ModelRunner(model, kv, CPU)
        runner.fused = FakeFused(32, 8, 512)
        agree_capabilities(runner, RowsComm([1, 4, 256, 16, 64]))  # the other rank's kernel takes fewer rows
        assert isinstance(runner.fused, _CappedFused)
        assert (runner.fused.max_batch, runner.fused.max_step_tokens) == (4, 256)
        agree_capabilities(runner, RowsComm([0, 0, 0, 16, 64]))  # the other rank has no fused forward
        assert runner.fused is None
        with pytest.raises(ValueError, match="KV layouts differ"):
            agree_capabilities(runner, RowsComm([0, 0, 0, 32, 64]))
    finally:
        kv.close()


def test_plan_channel_delivers_in_order_through_a_small_ring():
    writer = PlanChannel.create(2, 4096, slots=2)
    reader = PlanChannel.attach(writer.spec, 1)
    got: list[tuple[int, bytes]] = []

    def read():
        while True:
            kind, payload = reader.receive(lambda: True)
            got.append((kind, payload))
            if kind == SHUTDOWN:
                return

    t = threading.Thread(target=read)
    t.start()
    try:
        sent = [(STEP, np.arange(i + 1, dtype=np.int64).tobytes()) for i in range(20)]
        for kind, payload in sent:
            writer.publish(kind, payload, timeout_s=10)
        writer.publish(SHUTDOWN, b"", timeout_s=10)
        t.join(10)
        assert not t.is_alive() and got == [*sent, (SHUTDOWN, b"")]
        with pytest.raises(ValueError, match="exceeds"):
            writer.publish(STEP, bytes(5000), timeout_s=1)
    finally:
        reader.close()
        writer.close()


def test_plan_channel_waits_are_bounded():
    writer = PlanChannel.create(2, 1024, slots=2)
    reader = PlanChannel.attach(writer.spec, 1)
    try:
        writer.publish(SETUP, b"a", timeout_s=1)
        writer.publish(STEP, b"b", timeout_s=1)
        with pytest.raises(RankFailed, match=r"rank\(s\) \[1\]"):  # the ring is full, nobody reads
            writer.publish(STEP, b"c", timeout_s=0.2)
        assert reader.receive(lambda: True) == (SETUP, b"a")
        assert reader.receive(lambda: True) == (STEP, b"b")
        with pytest.raises(RankFailed, match="rank 0"):  # no message and the writer is gone
            reader.receive(lambda: False, poll_s=0.01, spin=1)
    finally:
        reader.close()
        writer.close()


def stamp_pages(kv: XTensorKVCache) -> None:
    """Write each page's id into its first value of layer 0's K range (every page: the memfd directly)."""
    store = kv.page_store()
    buf = np.frombuffer(store.buffers[0], dtype=np.float32)
    per_page = store.page_bytes[0] // 4
    for page in range(kv.layout.num_blocks):
        buf[page * per_page] = page


def test_xtensor_mirror_applies_the_same_mappings():
    spec = TinyLM().kv_cache_spec()
    lay = layout(spec, num_blocks=12, max_num_seqs=3)  # 4 blocks of 64 tokens per slot
    rank0 = XTensorKVCache(lay, map_budget=8)  # a small map budget: positions get unmapped to make room
    mirror = XTensorKVCache(lay, map_budget=lay.num_blocks)
    rank0.record_mappings()
    try:
        def check():
            # as before a step: every position the step reads is mapped (the engine's allocation waits for the
            # mapper thread's maps of its positions before the runner drains the log)
            for slot, block in list(rank0._mapped):
                rank0._wait_mapped(slot, block)
            mirror.apply_mappings(rank0.drain_mappings())
            stamp_pages(rank0)
            stamp_pages(mirror)
            k0, km = rank0.layer_kv(0)[0], mirror.layer_kv(0)[0]
            for slot, block in rank0._mapped:
                row = block * lay.block_size
                assert float(km[slot, row].flatten()[0]) == float(k0[slot, row].flatten()[0]), (slot, block)
            assert rank0._mapped  # something was compared

        system = list(range(1000, 1128))  # two blocks shared by a prefix
        a = seq("a", [*system, 1, 2, 3])
        assert rank0.admit(a, 131) == 131
        a.num_computed_tokens = 131
        rank0.on_computed(a)
        b = seq("b", [*system, 9])
        assert rank0.admit(b, 129) > 0 and b.num_computed_tokens == 128  # a prefix hit: a's pages in b's slot
        check()
        a.output_ids.extend([5] * 61)
        a.num_computed_tokens = 191
        rank0.prefetch([a])  # position 192 starts block 3: mapped ahead on the mapper thread
        assert len(a.kv_pages) == 4
        check()
        rank0.free(a)
        c = seq("c", list(range(2000, 2200)))
        assert rank0.admit(c, 200) == 200  # a's slot and pages: reuse in place, retargets, unmaps (budget 8)
        check()
        rank0.free(b)
        rank0.free(c)
        d = seq("d", list(range(3000, 3250)))
        assert rank0.admit(d, 250) == 250
        check()
        with pytest.raises(ValueError, match="outside the layout"):
            mirror.apply_mappings([(9, 0, 0, 1)])
    finally:
        rank0.close()
        mirror.close()
