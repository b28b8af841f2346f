"""DecodeFirstPolicy against fake scheduler queues over a KV allocator with a block budget (pure Python, no torch)."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections import deque
from dataclasses import dataclass

import pytest

from xllm.common import UnknownNameError
from xllm.sched import BATCH_POLICIES, DecodeFirstPolicy, StepPlan


@dataclass(eq=False)
class FakeSeq:
    name: str
    num_tokens: int
    num_computed_tokens: int = 0
    priority: int = 0
    arrival_time: float = 0.0

    def __repr__(self) -> str:
        return self.name


def decoding(name: str, length: int = 10, **kw) -> FakeSeq:
    """A running sequence whose next step is one decode token."""
    return FakeSeq(name, length, length - 1, **kw)


class FakeKV:
    """Block accounting like the real backends: a sequence holds ceil(tokens / block) blocks."""

    def __init__(self, num_blocks: int, block_size: int = 4) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.held: dict[int, int] = {}
        self.freed: list[FakeSeq] = []

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - sum(self.held.values())

    def hold(self, seq: FakeSeq, tokens: int) -> None:
        """Pretend ``seq`` already owns KV for ``tokens`` tokens."""
        self.held[id(seq)] = math.ceil(tokens / self.block_size)
        assert self.free_blocks >= 0

    def allocate(self, seq, num_new_tokens: int) -> bool:
        need = math.ceil((seq.num_computed_tokens + num_new_tokens) / self.block_size)
        extra = need - self.held.get(id(seq), 0)
        if extra > self.free_blocks:
            return False
        self.held[id(seq)] = max(need, self.held.get(id(seq), 0))
        return True

    def admit(self, seq, max_new_tokens: int) -> int:
        n = min(seq.num_tokens - seq.num_computed_tokens, max_new_tokens)
        return n if self.allocate(seq, n) else 0

    def free(self, seq) -> None:
        self.held.pop(id(seq), None)
        self.freed.append(seq)


class FakeQueues:
    """The engine scheduler's part, as the policy sees it (``xllm.sched.SchedulerQueues``): the
    queues are the given ``running`` list and ``waiting`` deque, changed only by the operations."""

    def __init__(self, running: list, waiting: deque, kv: FakeKV) -> None:
        self._running, self._waiting, self.kv = running, waiting, kv

    @property
    def running(self) -> list:
        return list(self._running)

    @property
    def waiting(self) -> list:
        return list(self._waiting)

    def allocate(self, seq, num_new_tokens: int) -> bool:
        return self.kv.allocate(seq, num_new_tokens)

    def admit(self, seq, max_new_tokens: int) -> int:
        assert self._waiting[0] is seq, "only the head of waiting is admitted"
        n = self.kv.admit(seq, max_new_tokens)
        if n:
            self._waiting.popleft()
            self._running.append(seq)
        return n

    def preempt(self, seq) -> None:
        self.kv.free(seq)
        self._running.remove(seq)
        self._waiting.appendleft(seq)
        seq.num_computed_tokens = 0


def schedule(policy: DecodeFirstPolicy, running: list, waiting: deque, kv: FakeKV) -> StepPlan:
    return policy.schedule(FakeQueues(running, waiting, kv))


def chunk_list(plan: StepPlan) -> list[tuple[str, int]]:
    return [(c.seq.name, c.num_tokens) for c in plan.chunks]


def test_decodes_are_scheduled_before_prefills():
    pre = FakeSeq("pre", 20, 8, arrival_time=0.0)  # partially prefilled, listed first
    d1 = decoding("d1", arrival_time=1.0)
    d2 = decoding("d2", arrival_time=2.0)
    running = [pre, d1, d2]
    waiting = deque([FakeSeq("new", 5, arrival_time=3.0)])
    plan = schedule(DecodeFirstPolicy(8, 100), running, waiting, FakeKV(100))
    assert chunk_list(plan) == [("d1", 1), ("d2", 1), ("pre", 12), ("new", 5)]
    assert [s.name for s in plan.admitted] == ["new"]
    assert running[-1].name == "new" and not waiting
    assert plan.num_tokens == 19 and not plan.preempted


def test_token_budget_respected_with_chunked_prefill():
    d1, d2 = decoding("d1"), decoding("d2")
    pre = FakeSeq("pre", 50, 10)
    running = [pre, d1, d2]
    new = FakeSeq("new", 30)
    waiting = deque([new])
    plan = schedule(DecodeFirstPolicy(8, 10), running, waiting, FakeKV(100))
    # Both decodes, then the prefill gets exactly what is left; nothing is admitted.
    assert chunk_list(plan) == [("d1", 1), ("d2", 1), ("pre", 8)]
    assert plan.num_tokens == 10
    assert list(waiting) == [new] and not plan.admitted

    # With budget left after the running work, a waiting prompt is admitted as a chunk.
    plan = schedule(DecodeFirstPolicy(8, 16), [d1], deque([new]), FakeKV(100))
    assert chunk_list(plan) == [("d1", 1), ("new", 15)]


def test_budget_smaller_than_decodes_schedules_at_most_budget():
    running = [decoding(f"d{i}") for i in range(5)]
    plan = schedule(DecodeFirstPolicy(8, 3), running, deque(), FakeKV(100))
    assert chunk_list(plan) == [("d0", 1), ("d1", 1), ("d2", 1)]


def test_without_chunking_a_prefill_that_does_not_fit_is_not_split():
    pre = FakeSeq("pre", 40, 0)
    d = decoding("d")
    small = FakeSeq("small", 4)
    plan = schedule(DecodeFirstPolicy(8, 20, chunked_prefill=False), [d, pre], deque([small]), FakeKV(100))
    assert chunk_list(plan) == [("d", 1), ("small", 4)]
    plan = schedule(DecodeFirstPolicy(8, 20, chunked_prefill=False), [], deque([FakeSeq("big", 21)]), FakeKV(100))
    assert not plan and not plan.admitted


def test_admission_stops_at_max_num_seqs_and_keeps_service_order():
    running = [decoding("r0")]
    waiting = deque(FakeSeq(f"w{i}", 3, arrival_time=float(i)) for i in range(5))
    plan = schedule(DecodeFirstPolicy(max_num_seqs=3, max_num_batched_tokens=1000), running, waiting, FakeKV(100))
    assert [s.name for s in plan.admitted] == ["w0", "w1"]
    assert [s.name for s in running] == ["r0", "w0", "w1"]
    assert [s.name for s in waiting] == ["w2", "w3", "w4"]
    assert chunk_list(plan) == [("r0", 1), ("w0", 3), ("w1", 3)]


def test_admission_stops_at_first_waiting_that_does_not_fit_in_kv():
    kv = FakeKV(num_blocks=3, block_size=4)
    waiting = deque([FakeSeq("a", 8), FakeSeq("b", 8), FakeSeq("c", 1)])
    plan = schedule(DecodeFirstPolicy(8, 1000), [], waiting, kv)
    # "a" takes 2 blocks, "b" needs 2 of the 1 left: admission stops (no overtaking by "c").
    assert [s.name for s in plan.admitted] == ["a"]
    assert [s.name for s in waiting] == ["b", "c"]
    assert kv.free_blocks == 1


def test_preemption_picks_lowest_priority_then_latest_and_requeues_it_first():
    kv = FakeKV(num_blocks=6, block_size=4)
    # a and b cross a block boundary this decode (9 tokens -> 3rd block); c still fits in its 2 blocks.
    a = FakeSeq("a", 9, 8, priority=0, arrival_time=0.0)
    b = FakeSeq("b", 9, 8, priority=1, arrival_time=1.0)   # lowest priority (larger value), arrived earlier
    c = FakeSeq("c", 8, 7, priority=0, arrival_time=2.0)   # latest arrival
    for s in (a, b, c):
        kv.hold(s, 8)
    assert kv.free_blocks == 0
    queued = FakeSeq("queued", 2, priority=0, arrival_time=3.0)
    running, waiting = [a, b, c], deque([queued])
    plan = schedule(DecodeFirstPolicy(8, 100), running, waiting, kv)
    # a needs a block: b is the victim (priority beats arrival), not c.
    assert plan.preempted == [b]
    assert kv.freed == [b]
    assert chunk_list(plan) == [("a", 1), ("c", 1)]
    assert running == [a, c]
    assert list(waiting) == [b, queued]  # victim goes to the front of waiting
    # No admission in a step that preempted, although budget, a slot and a free block are left.
    assert kv.free_blocks == 1 and not plan.admitted


def test_preemption_among_equal_priorities_takes_the_latest_arrival():
    kv = FakeKV(num_blocks=6, block_size=4)
    seqs = [FakeSeq(n, 9, 8, arrival_time=t) for n, t in (("a", 0.0), ("late", 5.0), ("b", 1.0))]
    for s in seqs:
        kv.hold(s, 8)
    running, waiting = list(seqs), deque()
    plan = schedule(DecodeFirstPolicy(8, 100), running, waiting, kv)
    assert [s.name for s in plan.preempted] == ["late"]
    assert [s.name for s in waiting] == ["late"]
    assert chunk_list(plan) == [("a", 1), ("b", 1)]


def test_a_sequence_that_is_itself_least_important_yields_instead_of_evicting():
    kv = FakeKV(num_blocks=4, block_size=4)
    low = FakeSeq("low", 9, 8, priority=5, arrival_time=0.0)   # listed first, needs a block
    high = FakeSeq("high", 9, 8, priority=0, arrival_time=1.0)
    kv.hold(low, 8)
    kv.hold(high, 8)
    running, waiting = [low, high], deque()
    plan = schedule(DecodeFirstPolicy(8, 100), running, waiting, kv)
    assert plan.preempted == [low]
    assert running == [high] and list(waiting) == [low]
    # With low's blocks released, high (more important) still runs this step.
    assert chunk_list(plan) == [("high", 1)]


def test_already_scheduled_sequences_are_never_preempted():
    kv = FakeKV(num_blocks=5, block_size=4)
    first = FakeSeq("first", 9, 8, priority=9, arrival_time=9.0)  # least important, but scheduled first
    mid = FakeSeq("mid", 9, 8, priority=0, arrival_time=0.0)
    kv.hold(first, 8)
    kv.hold(mid, 8)
    # one free block: "first" takes it; "mid" then needs one and may only evict itself.
    running, waiting = [first, mid], deque()
    plan = schedule(DecodeFirstPolicy(8, 100), running, waiting, kv)
    assert chunk_list(plan) == [("first", 1)]
    assert plan.preempted == [mid]


class Driver:
    """Plays the engine's part: applies plans, appends a token when a sequence is caught up."""

    def __init__(self, policy: DecodeFirstPolicy, kv: FakeKV, targets: dict[int, int]) -> None:
        self.policy, self.kv, self.targets = policy, kv, targets
        self.running: list[FakeSeq] = []
        self.waiting: deque[FakeSeq] = deque()
        self.done: list[FakeSeq] = []
        self.preemptions = 0

    def step(self) -> StepPlan:
        plan = schedule(self.policy, self.running, self.waiting, self.kv)
        self.preemptions += len(plan.preempted)
        names = [id(c.seq) for c in plan.chunks]
        assert len(names) == len(set(names)), "a sequence was scheduled twice"
        assert plan.num_tokens <= self.policy.max_num_batched_tokens
        assert len(self.running) <= self.policy.max_num_seqs
        assert self.kv.free_blocks >= 0
        kinds = [c.seq.num_tokens - c.seq.num_computed_tokens == 1 and c.seq.num_computed_tokens > 0
                 for c in plan.chunks]
        assert kinds == sorted(kinds, reverse=True), "a decode was scheduled after a prefill"
        if plan.preempted:
            assert not plan.admitted
        for c in plan.chunks:
            s = c.seq
            assert c.num_tokens >= 1 and s.num_computed_tokens + c.num_tokens <= s.num_tokens
            s.num_computed_tokens += c.num_tokens
            if s.num_computed_tokens == s.num_tokens:
                if s.num_tokens == self.targets[id(s)]:
                    self.running.remove(s)
                    self.kv.free(s)
                    self.done.append(s)
                else:
                    s.num_tokens += 1
        return plan


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_complete_under_memory_pressure(seed):
    rng = random.Random(seed)
    kv = FakeKV(num_blocks=12, block_size=4)
    seqs = []
    targets = {}
    for i in range(12):
        prompt = rng.randint(1, 14)
        s = FakeSeq(f"s{i}", prompt, priority=rng.randint(0, 2), arrival_time=float(i))
        targets[id(s)] = prompt + rng.randint(1, 20)
        assert math.ceil(targets[id(s)] / 4) <= kv.num_blocks  # every sequence fits alone
        seqs.append(s)
    drv = Driver(DecodeFirstPolicy(max_num_seqs=4, max_num_batched_tokens=rng.choice([3, 7, 16])), kv, targets)
    pending = list(seqs)
    for _ in range(5000):
        if pending and rng.random() < 0.3:
            drv.waiting.append(pending.pop(0))
        drv.step()
        if not pending and not drv.running and not drv.waiting:
            break
    assert sorted(s.name for s in drv.done) == sorted(s.name for s in seqs)
    assert all(s.num_tokens == targets[id(s)] for s in drv.done)
    assert kv.free_blocks == kv.num_blocks
    assert drv.preemptions > 0  # the pool is small enough that the test exercises preemption


def test_invalid_limits_and_registry():
    with pytest.raises(ValueError):
        DecodeFirstPolicy(0, 10)
    with pytest.raises(ValueError):
        DecodeFirstPolicy(4, 0)
    policy = BATCH_POLICIES.create("decode_first", max_num_seqs=3, max_num_batched_tokens=7)
    assert isinstance(policy, DecodeFirstPolicy)
    assert (policy.max_num_seqs, policy.max_num_batched_tokens) == (3, 7)
    with pytest.raises(UnknownNameError, match="decode_first"):
        BATCH_POLICIES.create("round_robin")


def test_import_does_not_pull_torch():
    code = ("import sys, xllm.sched; from xllm.sched import BATCH_POLICIES; "
            "BATCH_POLICIES.create('decode_first', max_num_seqs=1, max_num_batched_tokens=1); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
