"""ColocationPolicy against fake scheduler queues (pure Python, no torch): identical to DecodeFirstPolicy
without offline sequences, offline admission under a TPOT budget from a synthetic predictor, preemption
when the batch is full, interruption at chunk boundaries, the starvation bound."""

from __future__ import annotations

import copy
import math
import random
from collections import deque
from dataclasses import dataclass

import pytest

from xllm.sched import BATCH_POLICIES, DecodeFirstPolicy, StepPlan
from xllm.sched.batch_policy import DEFAULT_OFFLINE_SLO_FRACTION, BatchSettings
from xllm.sched.colocation import ColocationPolicy, average_cap
from xllm.sched.latency import StepShape, step_shape


@dataclass(eq=False)
class FakeSeq:
    name: str
    num_tokens: int
    num_computed_tokens: int = 0
    priority: int = 0
    arrival_time: float = 0.0
    offline: bool = False

    def __repr__(self) -> str:
        return self.name


def decoding(name: str, length: int = 10, **kw) -> FakeSeq:
    return FakeSeq(name, length, length - 1, **kw)


class FakeKV:
    """Block accounting like the real backends: a sequence holds ceil(tokens / block) blocks."""

    def __init__(self, num_blocks: int = 1000, block_size: int = 4) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.held: dict[int, int] = {}

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - sum(self.held.values())

    def hold(self, seq: FakeSeq, tokens: int) -> None:
        self.held[id(seq)] = math.ceil(tokens / self.block_size)

    def allocate(self, seq, n: int) -> bool:
        need = math.ceil((seq.num_computed_tokens + n) / self.block_size)
        extra = need - self.held.get(id(seq), 0)
        if extra > self.free_blocks:
            return False
        self.held[id(seq)] = max(need, self.held.get(id(seq), 0))
        return True

    def free(self, seq) -> None:
        self.held.pop(id(seq), None)


class FakeQueues:
    """``xllm.sched.SchedulerQueues`` over a list and a deque, like the engine's scheduler: any
    waiting sequence may be admitted; a preempted one goes to the front of ``waiting``."""

    def __init__(self, running: list, waiting: deque, kv: FakeKV) -> None:
        self._running, self._waiting, self.kv = running, waiting, kv

    @property
    def running(self) -> list:
        return list(self._running)

    @property
    def waiting(self) -> list:
        return list(self._waiting)

    def allocate(self, seq, n: int) -> bool:
        return self.kv.allocate(seq, n)

    def admit(self, seq, max_new_tokens: int) -> int:
        n = min(seq.num_tokens - seq.num_computed_tokens, max_new_tokens)
        if not self.kv.allocate(seq, n):
            return 0
        self._waiting.remove(seq)
        self._running.append(seq)
        return n

    def preempt(self, seq) -> None:
        self.kv.free(seq)
        self._running.remove(seq)
        self._waiting.appendleft(seq)
        seq.num_computed_tokens = 0


def run(policy, running: list, waiting: deque | list, kv: FakeKV | None = None) -> StepPlan:
    return policy.schedule(FakeQueues(running, waiting if isinstance(waiting, deque) else deque(waiting),
                                      kv or FakeKV()))


def chunks(plan: StepPlan) -> list[tuple[str, int]]:
    return [(c.seq.name, c.num_tokens) for c in plan.chunks]


def names(seqs) -> list[str]:
    return [s.name for s in seqs]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def linear_predictor(per_row: float = 0.01, base: float = 0.0):
    """Synthetic step time: ``base`` + ``per_row`` per token the step computes."""
    return lambda shape: base + per_row * shape.tokens


# ---- identical to DecodeFirstPolicy without offline sequences ----------------------------------------


def random_state(rng: random.Random):
    kv = FakeKV(num_blocks=rng.randint(4, 40), block_size=4)
    running, waiting = [], deque()
    for i in range(rng.randint(0, 10)):
        length = rng.randint(2, 30)
        computed = length - 1 if rng.random() < 0.6 else rng.randint(0, length - 2)
        s = FakeSeq(f"r{i}", length, computed, priority=rng.randint(-1, 2), arrival_time=rng.random() * 10)
        if math.ceil(computed / 4) <= kv.free_blocks:
            kv.hold(s, computed)
            running.append(s)
    for i in range(rng.randint(0, 8)):
        waiting.append(FakeSeq(f"w{i}", rng.randint(1, 40), priority=rng.randint(-1, 2),
                               arrival_time=10 + rng.random() * 10))
    waiting = deque(sorted(waiting, key=lambda s: (s.priority, s.arrival_time)))
    return running, waiting, kv


@pytest.mark.parametrize("chunked", [True, False])
def test_without_offline_sequences_decisions_equal_decode_first(chunked):
    rng = random.Random(14 + chunked)
    preempting = admitting = 0
    for _ in range(400):
        state = random_state(rng)
        max_seqs, budget = rng.randint(1, 12), rng.choice([1, 3, 8, 16, 64])
        ref_state = copy.deepcopy(state)
        by_name = {s.name: s for s in ref_state[0] + list(ref_state[1])}
        # the same sequences' KV, keyed by the copies' ids
        ref_state[2].held = {id(by_name[s.name]): state[2].held[id(s)] for s in state[0] if id(s) in state[2].held}
        ref = run(DecodeFirstPolicy(max_seqs, budget, chunked_prefill=chunked), *ref_state)
        predict = linear_predictor(0.001)  # an SLO and a predictor change nothing for online work
        got = run(ColocationPolicy(max_seqs, budget, chunked_prefill=chunked, slo_tpot_s=0.001, predict=predict),
                  *state)
        assert chunks(got) == chunks(ref)
        assert names(got.admitted) == names(ref.admitted)
        assert names(got.preempted) == names(ref.preempted)
        assert got.preempt_reasons == ref.preempt_reasons == ["kv"] * len(ref.preempted)
        assert names(state[0]) == names(ref_state[0]) and names(state[1]) == names(ref_state[1])
        assert not got.interrupted and got.longest_offline_wait == 0.0
        preempting += bool(ref.preempted)
        admitting += bool(ref.admitted)
    assert preempting > 20 and admitting > 30  # the random states exercise both


def test_registered_and_validated():
    policy = BATCH_POLICIES.create("colocation", max_num_seqs=3, max_num_batched_tokens=7, slo_tpot_s=0.1)
    assert isinstance(policy, ColocationPolicy) and policy.slo_tpot_s == 0.1
    assert policy.slo_fraction == DEFAULT_OFFLINE_SLO_FRACTION < 1
    for bad in ({"max_num_seqs": 0}, {"slo_tpot_s": 0.0}, {"starvation_s": 0.0}, {"starved_chunk_tokens": 0},
                {"slo_fraction": 0.0}, {"slo_fraction": 1.5}):
        with pytest.raises(ValueError):
            ColocationPolicy(**{"max_num_seqs": 2, "max_num_batched_tokens": 8, **bad})


def test_built_from_batch_settings():
    """Every registered policy builds from the engine's one settings object, taking what it uses."""
    clock = iter(range(100)).__next__
    settings = BatchSettings(4, 32, chunked_prefill=False, slo_tpot_s=0.05, offline_slo_fraction=0.9,
                             predict=linear_predictor(0.01), starvation_s=7.0, clock=clock)
    colo = BATCH_POLICIES.get("colocation").from_settings(settings)
    assert isinstance(colo, ColocationPolicy)
    assert (colo.max_num_seqs, colo.max_num_batched_tokens, colo.chunked_prefill) == (4, 32, False)
    assert (colo.slo_tpot_s, colo.slo_fraction, colo.starvation_s) == (0.05, 0.9, 7.0)
    assert colo.predict is settings.predict and colo.clock is clock
    first = BATCH_POLICIES.get("decode_first").from_settings(settings)
    assert isinstance(first, DecodeFirstPolicy)
    assert (first.max_num_seqs, first.max_num_batched_tokens, first.chunked_prefill) == (4, 32, False)


# ---- offline work fills what online work leaves ------------------------------------------------------


def test_offline_decodes_admitted_only_within_the_tpot_budget():
    online = [decoding(f"on{i}", arrival_time=float(i)) for i in range(4)]
    offline = [decoding(f"off{i}", arrival_time=10.0 + i, offline=True) for i in range(5)]
    predict = linear_predictor(0.01)  # 10 ms per row: a 65 ms SLO fits 6 rows
    running = offline[::-1] + online  # offline listed first: order in `running` does not matter
    plan = run(ColocationPolicy(16, 64, slo_tpot_s=0.065, predict=predict, slo_fraction=1.0), running, [])
    assert chunks(plan) == [(s.name, 1) for s in online] + [("off0", 1), ("off1", 1)]
    assert predict(step_shape([(c.seq, c.num_tokens) for c in plan.chunks])) <= 0.065
    assert not plan.preempted  # the others wait, keeping their KV
    # headroom: a step with offline work is capped at slo_fraction x the SLO (0.8 x 65 ms fits 5 rows)
    plan = run(ColocationPolicy(16, 64, slo_tpot_s=0.065, predict=predict, slo_fraction=0.8), list(running), [])
    assert chunks(plan) == [(s.name, 1) for s in online] + [("off0", 1)]
    plan = run(ColocationPolicy(16, 64, slo_tpot_s=0.065, predict=predict, slo_fraction=0.6), list(running), [])
    assert chunks(plan) == [(s.name, 1) for s in online]  # 39 ms: online work alone already takes 40
    # no SLO, or no prediction yet: offline takes what online leaves of the budget
    plan = run(ColocationPolicy(16, 7, slo_tpot_s=0.065, predict=lambda shape: None), list(running), [])
    assert chunks(plan) == [(s.name, 1) for s in online] + [("off0", 1), ("off1", 1), ("off2", 1)]
    plan = run(ColocationPolicy(16, 64), list(running), [])
    assert len(plan.chunks) == 9
    # with no online work in the queues there is nothing to protect: the SLO does not cap
    plan = run(ColocationPolicy(16, 64, slo_tpot_s=0.025, predict=predict), offline[::-1], [])
    assert chunks(plan) == [(s.name, 1) for s in offline]


def test_average_cap_is_the_largest_fill_that_keeps_the_mean_within_the_target():
    rng = random.Random(7)
    for _ in range(500):
        bases = [rng.choice([rng.uniform(0, 0.05), rng.uniform(0.05, 0.4)]) for _ in range(rng.randint(1, 12))]
        target = rng.uniform(0.01, 0.2)
        c = average_cap(bases, target)

        def mean_filled(x: float, bases: list[float] = bases) -> float:
            return sum(max(b, x) for b in bases) / len(bases)

        if sum(bases) / len(bases) > target:
            assert c == 0.0  # the bases alone are over: no room at all
            continue
        # oracle: bisection on the monotone mean, independent of the closed form
        lo, hi = 0.0, target
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mean_filled(mid) <= target else (lo, mid)
        assert c == pytest.approx(lo, abs=1e-9) and mean_filled(c) <= target + 1e-12
    assert average_cap([], 0.05) == 0.05 and average_cap([0.01, 0.02], 0.05) == 0.05


def test_steps_heavy_with_online_prefill_leave_less_room_for_offline_rows():
    """The cap targets the average of the steps online decodes see: after steps whose online part
    alone ran long (prefill chunks), a decode-only step takes fewer offline rows than a fresh policy
    gives it, and none once the recent online steps alone average above the target. (The decode rows
    checked are new sequences and misses do not back off, so that only the window speaks, not the
    lives of the ones that were in the heavy steps nor their misses: see the next two tests.)"""
    predict = linear_predictor(0.01)  # 10 ms per token
    offline = [decoding(f"off{i}", arrival_time=10.0 + i, offline=True) for i in range(6)]

    def pair(tag: str) -> list[FakeSeq]:
        return [decoding(f"{tag}{i}", arrival_time=float(i)) for i in range(2)]

    def offline_rows(policy: ColocationPolicy, online: list[FakeSeq]) -> int:
        plan = run(policy, [*online, *offline], [])
        return sum(c.seq.offline for c in plan.chunks)

    def heavy(policy: ColocationPolicy) -> None:  # 2 decode rows + a 6-token online prefill chunk: 80 ms
        plan = run(policy, [*pair("h"), FakeSeq("pre", 30, 24)], [])
        assert sum(c.num_tokens for c in plan.chunks) == 8

    slo = 0.0605  # a hair over 60 ms: float sums of 10 ms rows stay clear of the boundary
    fresh = ColocationPolicy(16, 64, slo_tpot_s=slo, predict=predict, slo_fraction=1.0)
    assert offline_rows(fresh, pair("on")) == 4  # 2 online + 4 offline rows: 60 ms
    for heavy_steps, expected in ((1, 2), (3, 0)):
        policy = ColocationPolicy(16, 64, slo_tpot_s=slo, predict=predict, slo_fraction=1.0, window_steps=4,
                                  miss_backoff=1.0)
        for _ in range(heavy_steps):
            heavy(policy)
        # one heavy step: mean(80, c) <= 60.5 -> c = 41 ms: 2 online + 2 offline rows; three heavy
        # ones and this step's 20 ms average 65 ms alone: no offline row fits
        assert offline_rows(policy, pair("on")) == expected
    policy = ColocationPolicy(16, 64, slo_tpot_s=slo, predict=predict, slo_fraction=1.0, window_steps=2,
                              miss_backoff=1.0)
    for _ in range(3):
        heavy(policy)
    assert offline_rows(policy, pair("a")) == 2  # window (80, 20)
    assert offline_rows(policy, pair("b")) == 4  # the heavy steps left the 2-step window: the full room is back


def test_a_request_behind_its_target_decodes_without_offline_work_until_it_is_back():
    """Each online decode row caps the step at what keeps its own running average within the target:
    requests that decoded through steps heavy with online prefill get offline-free steps, however much
    room the window shows, until their average is back on the target; newcomers to the same steps
    leave the offline work out too (the step is shared)."""
    predict = linear_predictor(0.01)  # 10 ms per token
    offline = [decoding(f"off{i}", arrival_time=10.0 + i, offline=True) for i in range(6)]
    hit = [decoding(f"hit{i}", arrival_time=float(i)) for i in range(2)]
    slo = 0.0605
    policy = ColocationPolicy(16, 64, slo_tpot_s=slo, predict=predict, slo_fraction=1.0, window_steps=1)
    plan = run(policy, [*hit, FakeSeq("pre", 30, 24)], [])  # 2 rows + 6 prefill tokens: 80 ms
    assert chunks(plan) == [("hit0", 1), ("hit1", 1), ("pre", 6)]
    # the window (1 step) forgot it; the lives did not: 60.5 x 2 - 80 = 41 ms -> 2 online + 2 offline rows
    plan = run(policy, [*hit, *offline], [])
    assert sum(c.seq.offline for c in plan.chunks) == 2  # their average is now (80 + 40) / 2 = 60 ms
    plan = run(policy, [*hit, *offline], [])  # 60.5 x 3 - 120 = 61.5 ms: 4 offline rows (60 ms)
    assert sum(c.seq.offline for c in plan.chunks) == 4
    # a step's rows share it: one request behind its target keeps the offline work out for all
    policy = ColocationPolicy(16, 64, slo_tpot_s=slo, predict=predict, slo_fraction=1.0, window_steps=1)
    run(policy, [hit[0], FakeSeq("big", 30, 20)], [])  # 1 row + 9 prefill tokens: 100 ms for hit0
    plan = run(policy, [hit[0], decoding("new"), *offline], [])  # 60.5 x 2 - 100 = 21 ms: the 2 rows alone
    assert chunks(plan) == [("hit0", 1), ("new", 1)]


def test_online_misses_shrink_the_offline_target_and_met_requests_restore_it():
    """When an online sequence leaves the queues, its predicted TPOT (its steps' seconds over their
    count) is an observation: over the SLO scales the offline target by miss_backoff, within it adds
    meet_regain back (up to 1)."""
    predict = linear_predictor(0.01)
    slo = 0.0605
    policy = ColocationPolicy(16, 64, slo_tpot_s=slo, predict=predict, slo_fraction=1.0, window_steps=1,
                              miss_backoff=0.5, meet_regain=0.25)
    late = decoding("late")
    run(policy, [late, FakeSeq("pre", 30, 22)], [])  # 1 row + 8 prefill tokens: 90 ms > 60.5
    assert policy.attainment_scale == 1.0              # still running: not an observation yet
    x = decoding("x")
    run(policy, [x], [])                               # `late` finished (left the queues): a miss
    assert policy.attainment_scale == 0.5
    offline = [decoding(f"off{i}", arrival_time=10.0 + i, offline=True) for i in range(6)]
    plan = run(policy, [x, *offline], [])              # target 30 ms: 1 online + 2 offline rows
    assert sum(c.seq.offline for c in plan.chunks) == 2
    z = decoding("z")
    run(policy, [z], [])                               # x finished within the SLO (10 and 30 ms): +0.25
    assert policy.attainment_scale == 0.75
    run(policy, [], [])                                # and z: +0.25, up to 1
    assert policy.attainment_scale == 1.0
    preempted = decoding("p")
    run(policy, [preempted, FakeSeq("pre", 30, 22)], [])
    run(policy, [], [preempted])                       # waiting again (preempted): its life goes on
    assert policy.attainment_scale == 1.0
    with pytest.raises(ValueError):
        ColocationPolicy(2, 8, miss_backoff=1.5)


def test_online_work_is_never_capped_by_the_slo():
    online = [decoding(f"on{i}") for i in range(4)]
    plan = run(ColocationPolicy(16, 64, slo_tpot_s=0.001, predict=linear_predictor(0.01)),
               [*online, decoding("off", offline=True)], [FakeSeq("new", 20, arrival_time=5.0)])
    assert chunks(plan) == [(s.name, 1) for s in online] + [("new", 20)]


def test_offline_prefill_chunk_is_the_largest_that_fits_the_slo():
    online = [decoding(f"on{i}") for i in range(2)]
    pre = FakeSeq("pre", 100, 30, offline=True)
    predict = linear_predictor(0.001, base=0.005)  # 5 ms + 1 ms per token
    plan = run(ColocationPolicy(8, 64, slo_tpot_s=0.0305, predict=predict, slo_fraction=1.0), [*online, pre], [])
    assert chunks(plan) == [("on0", 1), ("on1", 1), ("pre", 23)]  # 5 + 25 tokens = 30 ms; 26 would be 31
    # an offline prompt waiting is admitted with the same cap
    new = FakeSeq("new", 100, offline=True)
    plan = run(ColocationPolicy(8, 64, slo_tpot_s=0.0305, predict=predict, slo_fraction=1.0), list(online), [new])
    assert chunks(plan) == [("on0", 1), ("on1", 1), ("new", 23)] and plan.admitted == [new]
    # without chunked prefill an offline prompt runs whole or not at all
    plan = run(ColocationPolicy(8, 64, chunked_prefill=False, slo_tpot_s=0.0305, predict=predict, slo_fraction=1.0),
               list(online), [FakeSeq("whole", 40, offline=True)])
    assert chunks(plan) == [("on0", 1), ("on1", 1)]


def test_offline_prefills_get_budget_only_after_every_online_chunk():
    off_pre = FakeSeq("off_pre", 50, 10, offline=True, arrival_time=0.0)  # older than every online request
    on_pre = FakeSeq("on_pre", 30, 5, arrival_time=1.0)
    off_wait = FakeSeq("off_wait", 8, offline=True, arrival_time=0.5)
    on_wait = FakeSeq("on_wait", 6, arrival_time=2.0)
    plan = run(ColocationPolicy(8, 40), [off_pre, on_pre, decoding("d", offline=True)],
               deque([off_wait, on_wait]))
    assert chunks(plan) == [("d", 1), ("on_pre", 25), ("on_wait", 6), ("off_pre", 8)]
    assert names(plan.admitted) == ["on_wait"]


# ---- interruption at chunk boundaries ------------------------------------------------------------------


def test_offline_prefill_is_interrupted_at_a_chunk_boundary_and_resumes():
    policy = ColocationPolicy(8, 16)
    kv = FakeKV()
    pre = FakeSeq("pre", 64, 0, offline=True)
    running, waiting = [pre], deque()
    plan = run(policy, running, waiting, kv)
    assert chunks(plan) == [("pre", 16)]
    pre.num_computed_tokens += 16
    waiting.append(FakeSeq("online", 40, arrival_time=1.0))  # arrives: takes the whole budget
    plan = run(policy, running, waiting, kv)
    assert chunks(plan) == [("online", 16)]
    assert plan.interrupted == [pre] and not plan.preempted
    assert pre.num_computed_tokens == 16 and running[0] is pre  # its KV and progress are kept
    running[1].num_computed_tokens += 16
    plan = run(policy, running, waiting, kv)
    assert chunks(plan) == [("online", 16)] and not plan.interrupted  # counted once per interruption
    running[1].num_computed_tokens += 16
    plan = run(policy, running, waiting, kv)
    assert chunks(plan) == [("online", 8), ("pre", 8)]  # what the online prompt leaves, from token 16


# ---- preemption --------------------------------------------------------------------------------------


def test_a_full_batch_of_offline_work_makes_room_for_an_online_request():
    offline = [decoding(f"off{i}", arrival_time=float(i), offline=True) for i in range(3)]
    online = FakeSeq("online", 5, arrival_time=9.0)
    # DecodeFirstPolicy (and vLLM's priority scheduling) leave the online request waiting
    plan = run(DecodeFirstPolicy(3, 64), list(offline), [online])
    assert not plan.admitted and not plan.preempted
    running, waiting = list(offline), deque([online])
    plan = run(ColocationPolicy(3, 64), running, waiting)
    assert names(plan.preempted) == ["off2"] and plan.preempt_reasons == ["batch_full"]
    assert names(plan.admitted) == ["online"]
    assert chunks(plan) == [("off0", 1), ("off1", 1), ("online", 5)]
    assert names(running) == ["off0", "off1", "online"] and names(waiting) == ["off2"]


def test_kv_pressure_evicts_offline_before_any_online_sequence():
    kv = FakeKV(num_blocks=6, block_size=4)
    low = FakeSeq("low", 9, 8, priority=5, arrival_time=9.0)          # least important online sequence
    a = FakeSeq("a", 9, 8, arrival_time=0.0)                           # needs a third block
    off = FakeSeq("off", 8, 7, offline=True, arrival_time=1.0)         # an offline decode
    for s in (low, a, off):
        kv.hold(s, 8)
    running, waiting = [low, a, off], deque()
    plan = run(ColocationPolicy(8, 64), running, waiting, kv)
    assert names(plan.preempted) == ["off"] and plan.preempt_reasons == ["kv"]
    assert chunks(plan) == [("a", 1), ("low", 1)] or chunks(plan) == [("low", 1), ("a", 1)]
    # offline work short of KV yields itself rather than evict online work
    kv = FakeKV(num_blocks=4, block_size=4)
    on = FakeSeq("on", 8, 7, priority=9, arrival_time=9.0)
    off = FakeSeq("off", 9, 8, offline=True)
    kv.hold(on, 8)
    kv.hold(off, 8)
    plan = run(ColocationPolicy(8, 64), [off, on], [], kv)
    assert chunks(plan) == [("on", 1)] and names(plan.preempted) == ["off"]


def test_evicting_offline_work_for_online_decodes_does_not_hold_online_admissions_back():
    """An online decode that needs KV evicts an offline sequence; a waiting online request is still
    admitted in the same step (DecodeFirstPolicy skips admissions after a preemption, which under
    co-location, where evicting offline work is routine, would delay every online arrival)."""
    kv = FakeKV(num_blocks=6, block_size=4)                       # all held
    a = FakeSeq("a", 9, 8, arrival_time=0.0)                     # needs a third block
    off = FakeSeq("off", 16, 15, offline=True, arrival_time=1.0)  # four blocks
    kv.hold(a, 8)
    kv.hold(off, 15)
    new = FakeSeq("new", 6, arrival_time=2.0)
    plan = run(ColocationPolicy(8, 64), [a, off], [new], kv)
    assert names(plan.preempted) == ["off"] and plan.preempt_reasons == ["kv"]
    assert chunks(plan) == [("a", 1), ("new", 6)] and plan.admitted == [new]
    # online memory pressure (an online sequence preempted) still admits nothing new, as DecodeFirstPolicy
    kv = FakeKV(num_blocks=4, block_size=4)
    low = FakeSeq("low", 8, 7, priority=5, arrival_time=9.0)
    b = FakeSeq("b", 9, 8, arrival_time=0.0)
    kv.hold(low, 8)
    kv.hold(b, 8)
    plan = run(ColocationPolicy(8, 64), [b, low], [FakeSeq("new", 2, arrival_time=10.0)], kv)
    assert names(plan.preempted) == ["low"] and not plan.admitted


def test_online_admission_short_of_kv_evicts_offline():
    kv = FakeKV(num_blocks=4, block_size=4)
    off = FakeSeq("off", 12, 11, offline=True)
    kv.hold(off, 11)
    running, waiting = [off], deque([FakeSeq("on", 8, arrival_time=1.0)])
    plan = run(ColocationPolicy(8, 64), running, waiting, kv)
    assert names(plan.preempted) == ["off"] and plan.preempt_reasons == ["kv"]
    assert chunks(plan) == [("on", 8)]


# ---- starvation ------------------------------------------------------------------------------------------


def test_starvation_bound_one_sequence():
    """Online decodes alone exceed the SLO, so offline work gets nothing, until it has waited
    starvation_s: then one decode row per starvation period, never earlier."""
    clock = Clock()
    policy = ColocationPolicy(8, 64, slo_tpot_s=0.01, predict=linear_predictor(0.01), starvation_s=5.0, clock=clock)
    online = [decoding(f"on{i}") for i in range(3)]
    off = decoding("off", offline=True)
    running = [*online, off]
    progress = []
    for _ in range(120):  # 12 s in steps of 0.1 s
        plan = run(policy, running, [])
        assert [n for name, n in chunks(plan) if name.startswith("on")] == [1, 1, 1]
        if ("off", 1) in chunks(plan):
            progress.append(clock.now)
            assert chunks(plan)[0] == ("off", 1)  # served first, ahead of online rows
        assert plan.longest_offline_wait <= 5.0 + 1e-9
        clock.now = round(clock.now + 0.1, 6)
    assert progress == [5.0, 10.0]


def test_starvation_bound_rotates_through_the_starved():
    """Several starved sequences: the longest-starved first, one per step, so the k-th is served
    within k steps of starving; every one of them progresses within starvation_s + (count) steps."""
    clock = Clock()
    policy = ColocationPolicy(8, 64, slo_tpot_s=0.01, predict=linear_predictor(0.02), starvation_s=1.0, clock=clock)
    offline = [decoding(f"off{i}", offline=True, arrival_time=float(i)) for i in range(4)]
    running = [decoding("on"), *offline]
    last = {s.name: 0.0 for s in offline}
    worst = 0.0
    for _ in range(200):
        plan = run(policy, running, [])
        served = [name for name, _ in chunks(plan) if name.startswith("off")]
        assert len(served) <= 1
        for name in served:
            worst = max(worst, clock.now - last[name])
            last[name] = clock.now
        clock.now = round(clock.now + 0.1, 6)
    assert all(t > 15.0 for t in last.values())  # everyone kept progressing
    assert 1.0 <= worst <= 1.0 + len(offline) * 0.1 + 1e-9


def test_starved_waiting_request_is_admitted_with_a_small_chunk():
    clock = Clock()
    policy = ColocationPolicy(2, 64, slo_tpot_s=0.01, predict=linear_predictor(0.01), starvation_s=2.0,
                              clock=clock, starved_chunk_tokens=4)
    running = [decoding("on0")]
    waiting = deque([FakeSeq("off", 30, offline=True)])
    assert chunks(run(policy, running, waiting)) == [("on0", 1)]
    clock.now = 2.0
    plan = run(policy, running, waiting)
    assert chunks(plan) == [("on0", 1), ("off", 4)] and names(plan.admitted) == ["off"]


def test_randomized_mixed_workload_completes_with_invariants():
    """A driver plays the engine over random online/offline arrivals in a tiny KV pool: every request
    completes, budgets and slots hold, decode rows come first, and offline work never evicts online."""
    for seed in range(3):
        rng = random.Random(seed)
        clock = Clock()
        kv = FakeKV(num_blocks=14, block_size=4)
        policy = ColocationPolicy(4, rng.choice([4, 9, 16]), slo_tpot_s=0.05, predict=linear_predictor(0.01),
                                  starvation_s=0.5, clock=clock)
        targets, pending = {}, []
        for i in range(14):
            s = FakeSeq(f"s{i}", rng.randint(1, 14), priority=rng.randint(0, 1), arrival_time=float(i),
                        offline=rng.random() < 0.5)
            targets[id(s)] = s.num_tokens + rng.randint(1, 16)
            pending.append(s)
        running, waiting, done = [], deque(), []
        for _ in range(5000):
            if pending and rng.random() < 0.3:
                s = pending.pop(0)
                waiting.append(s)
            plan = run(policy, running, waiting, kv)
            assert plan.num_tokens <= policy.max_num_batched_tokens and len(running) <= policy.max_num_seqs
            assert kv.free_blocks >= 0
            rows = [c.num_tokens == 1 and c.seq.num_computed_tokens + 1 == c.seq.num_tokens
                    and c.seq.num_computed_tokens > 0 for c in plan.chunks]
            assert rows == sorted(rows, reverse=True)
            for c in plan.chunks:
                s = c.seq
                s.num_computed_tokens += c.num_tokens
                if s.num_computed_tokens == s.num_tokens:
                    if s.num_tokens == targets[id(s)]:
                        running.remove(s)
                        kv.free(s)
                        done.append(s)
                    else:
                        s.num_tokens += 1
            clock.now += 0.05
            if not pending and not running and not waiting:
                break
        assert len(done) == 14 and all(s.num_tokens == targets[id(s)] for s in done)
        assert kv.free_blocks == kv.num_blocks


def test_step_shape_reads_chunks_like_the_engine():
    seqs = [FakeSeq("d", 10, 9), FakeSeq("p", 10, 4), FakeSeq("one", 1, 0)]
    shape = step_shape([(seqs[0], 1), (seqs[1], 6), (seqs[2], 1)])
    assert shape == StepShape((10,), ((4, 6), (0, 1)))


def test_starved_share_leaves_the_online_decode_rows_their_budget():
    """Online decodes alone exceed the SLO (offline gets nothing) and nearly fill a 4-token budget: the
    starved prefill's share shrinks to what they leave (1 token), every online row still runs."""
    clock = Clock()
    policy = ColocationPolicy(8, 4, slo_tpot_s=0.01, predict=linear_predictor(0.01), starvation_s=1.0, clock=clock)
    online = [decoding(f"on{i}") for i in range(3)]
    pre = FakeSeq("pre", 40, 8, offline=True)
    running = [pre, *online]
    assert chunks(run(policy, running, [])) == [(s.name, 1) for s in online]
    clock.now = 1.0
    assert chunks(run(policy, running, [])) == [(s.name, 1) for s in online] + [("pre", 1)]
    policy = ColocationPolicy(8, 64, slo_tpot_s=0.01, predict=linear_predictor(0.01), starvation_s=1.0,
                              clock=clock, starved_chunk_tokens=16)
    clock.now = 2.0
    assert chunks(run(policy, running, [])) == [(s.name, 1) for s in online]
    clock.now = 3.0
    assert chunks(run(policy, running, [])) == [(s.name, 1) for s in online] + [("pre", 16)]
