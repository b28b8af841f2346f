"""The encode phase of multimodal requests (:mod:`xllm.sched.encode`) in both batch policies, against fake queues
with unlimited KV (pure Python): which sequences a step encodes, which it admits, and the profile's search."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from xllm.sched import BATCH_POLICIES, StepPlan
from xllm.sched.batch_policy import BatchSettings
from xllm.sched.encode import encodes_for_step, largest_within


@dataclass(eq=False)
class Seq:
    name: str
    num_tokens: int
    num_computed_tokens: int = 0
    encode_pending: int = 0
    offline: bool = False
    priority: int = 0
    arrival_time: float = 0.0

    def __repr__(self) -> str:
        return self.name


class Queues:
    """``xllm.sched.SchedulerQueues`` with room for everything; admission takes any waiting sequence (the
    engine's scheduler removes it wherever it stands)."""

    def __init__(self, running: list[Seq], waiting: list[Seq]) -> None:
        self._running, self._waiting = running, waiting

    @property
    def running(self) -> list[Seq]:
        return list(self._running)

    @property
    def waiting(self) -> list[Seq]:
        return list(self._waiting)

    def allocate(self, seq: Seq, n: int) -> bool:
        return True

    def admit(self, seq: Seq, max_new_tokens: int) -> int:
        self._waiting.remove(seq)
        self._running.append(seq)
        return min(seq.num_tokens - seq.num_computed_tokens, max_new_tokens)

    def preempt(self, seq: Seq) -> None:
        raise AssertionError("nothing is preempted with unlimited KV")


def image(name: str, images: int = 1, tokens: int = 40, **kw) -> Seq:
    return Seq(name, tokens, encode_pending=images, **kw)


def policy(kind: str, max_encode_images: int, max_num_seqs: int = 8, budget: int = 64):
    return BATCH_POLICIES.get(kind).from_settings(BatchSettings(max_num_seqs, budget,
                                                                max_encode_images=max_encode_images))


def step(p, running: list[Seq], waiting: list[Seq]) -> StepPlan:
    """One step over the (mutated) ``running`` and ``waiting`` lists, as the engine runs it: the plan's encodes
    done, its chunks computed, a token sampled where a prompt completes."""
    plan = p.schedule(Queues(running, waiting))
    for seq in plan.encodes:
        seq.encode_pending = 0
    for c in plan.chunks:
        c.seq.num_computed_tokens += c.num_tokens
        if c.seq.num_computed_tokens == c.seq.num_tokens:
            c.seq.num_tokens += 1
    return plan


def chunks(plan: StepPlan) -> list[tuple[str, int]]:
    return [(c.seq.name, c.num_tokens) for c in plan.chunks]


def names(seqs) -> list[str]:
    return [s.name for s in seqs]


def test_encodes_for_step_takes_online_first_in_order_within_the_bound_and_the_slots():
    a, b, c = image("a", 2), image("b", 1, offline=True), image("c", 2)
    text = Seq("text", 10)
    assert names(encodes_for_step([a, b, text, c], 4, 8)) == ["a", "c"]  # online first, then offline
    assert names(encodes_for_step([a, b, text, c], 3, 8)) == ["a"]        # c (2 more) would pass the bound
    assert names(encodes_for_step([a, b, text, c], 5, 8)) == ["a", "c", "b"]
    assert names(encodes_for_step([a, c], 4, 1)) == ["a"]                 # one free slot: one request
    assert names(encodes_for_step([image("big", 9), a], 4, 8)) == ["big"]  # over the bound: alone, not never
    assert encodes_for_step([a], 0, 8) == [] and encodes_for_step([a], 4, 0) == []


def test_largest_within_finds_the_largest_batch_under_the_limit_in_log_calls():
    calls: list[int] = []

    def measure(k: int) -> float:  # 3 ms + 2 ms per image
        calls.append(k)
        return 0.003 + 0.002 * k

    assert largest_within(measure, 0.020, 64) == 8       # 19 ms; 9 would take 21 ms
    assert len(calls) <= 8
    assert largest_within(measure, 0.001, 64) == 1       # even one image is over: a step still encodes one
    assert largest_within(measure, 1.0, 16) == 16        # everything fits: the cap
    assert largest_within(lambda k: 0.0, 1.0, 1) == 1
    with pytest.raises(ValueError):
        largest_within(measure, 1.0, 0)


@pytest.mark.parametrize("kind", ["decode_first", "colocation"])
def test_images_are_encoded_in_a_step_before_their_prefill_and_text_is_not_held_back(kind):
    p = policy(kind, max_encode_images=2)
    img, text = image("img"), Seq("text", 10)
    running, waiting = [], [img, text]
    plan = step(p, running, waiting)
    # the image request is not admitted (its images are not encoded); the text request behind it is
    assert names(plan.encodes) == ["img"] and names(plan.admitted) == ["text"]
    plan = step(p, running, waiting)
    assert names(plan.admitted) == ["img"] and plan.encodes == []  # encoded: its prefill starts
    assert chunks(plan) == [("text", 1), ("img", 40)]


@pytest.mark.parametrize("kind", ["decode_first", "colocation"])
def test_no_encode_while_a_prompt_is_mid_prefill_and_the_batch_is_bounded(kind):
    p = policy(kind, max_encode_images=3, budget=16)
    long, a, b, c = Seq("long", 40), image("a", 2), image("b", 2), image("c", 1)
    running, waiting = [], [long, a, b, c]
    plan = step(p, running, waiting)  # long's first chunk; no prompt was mid-prefill when the step began
    assert chunks(plan) == [("long", 16)] and names(plan.encodes) == ["a"]  # b (2 more) would pass 3 images
    while any(s.num_tokens - s.num_computed_tokens > 1 for s in running):  # a prompt mid-prefill: no encode
        plan = step(p, running, waiting)
        assert plan.encodes == []
    assert names(running) == ["long", "a"] and a.num_computed_tokens == 40  # a's prefill came after long's
    plan = step(p, running, waiting)  # nothing mid-prefill when the step began: the next batch (3 images)
    assert chunks(plan) == [("long", 1), ("a", 1)] and names(plan.encodes) == ["b", "c"]


@pytest.mark.parametrize("kind", ["decode_first", "colocation"])
def test_with_the_phase_off_images_are_admitted_as_text(kind):
    p = policy(kind, max_encode_images=0)
    running, waiting = [], [image("img")]
    plan = step(p, running, waiting)
    assert names(plan.admitted) == ["img"] and plan.encodes == []


def test_colocation_encodes_offline_images_after_online_ones_and_never_admits_them_unencoded():
    p = policy("colocation", max_encode_images=1)
    off, on = image("off", offline=True), image("on")
    running, waiting = [], [off, on]
    plan = step(p, running, waiting)
    assert names(plan.encodes) == ["on"] and plan.admitted == []
    plan = step(p, running, waiting)
    assert names(plan.admitted) == ["on"] and names(plan.encodes) == ["off"]  # (on's prompt fits the step whole)
    plan = step(p, running, waiting)
    assert names(plan.admitted) == ["off"] and chunks(plan) == [("on", 1), ("off", 40)]
