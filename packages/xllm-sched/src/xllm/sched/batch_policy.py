"""The engine's per-step batch policy: which tokens of which sequences run next.

Decode first, then chunked prefill under a token budget (xLLM §4.1, SARATHI
style): every running sequence that is decoding gets its one token, then
partially prefilled sequences continue, then waiting sequences are admitted in
(priority, arrival) order while budget, sequence slots and KV memory last.
When KV memory runs out for a running sequence, the lowest-priority, latest
arrived running sequence is preempted (its KV released, to be recomputed).
With the encode phase of multimodal requests on, a waiting sequence whose images
are not encoded yet is passed over by admission, and a step with no prompt
mid-prefill encodes a bounded batch of images (:mod:`xllm.sched.encode`).

The policy only *decides*. The queues, KV memory and the state of sequences
belong to the engine's scheduler (``xllm.core.scheduler.Scheduler``), which the
policy sees through :class:`SchedulerQueues`: it reads the queues and asks for
the three operations that change them (allocate, admit, preempt).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from xllm.sched.encode import encodes_for_step
from xllm.sched.latency import StepShape

# The engine's default token budget per step (--max-num-batched-tokens). Measured, not guessed: of
# 256..4096 it had the best goodput under a TTFT <= 1 s + TPOT <= 100 ms SLO on vLLM's client mixes
# (python -m benchmarks budget; docs/performance.md): 256 admits too little prefill per step, 1024 and
# more let a burst of short prompts queue behind one long step.
DEFAULT_TOKEN_BUDGET = 512

# The share of the online TPOT SLO that the average predicted step online decodes see may reach
# with offline work in the steps (--offline-slo-fraction; xllm.sched.colocation). Measured, not
# guessed (xllm-sim, 200 instances, online at 179 req/s plus as many offline requests, 20k each;
# docs/architecture.md "Cluster simulator"): online SLO attainment 85.2 % at 0.9, 89.4 % at 0.8,
# 90.3 % at 0.75, 90.8 % at 0.7 (online alone: 99.5 %), the offline backlog finishing as fast.
DEFAULT_OFFLINE_SLO_FRACTION = 0.7


@dataclass(frozen=True)
class BatchSettings:
    """An engine's batch-policy settings, the one set every policy of :data:`xllm.sched.BATCH_POLICIES`
    is built from (:meth:`BatchPolicyClass.from_settings`); each policy takes the ones it uses.

    ``slo_tpot_s``: the online TPOT target (``None``: none); ``offline_slo_fraction``: the share of it
    a step with offline work may be predicted to take; ``predict``: the step-time predictor
    (``None`` from it: no model yet); ``starvation_s``: the offline starvation bound; ``clock``: the
    time source (the simulator's clock in ``xllm-sim``).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool = True
    slo_tpot_s: float | None = None
    offline_slo_fraction: float = DEFAULT_OFFLINE_SLO_FRACTION
    predict: Callable[[StepShape], float | None] | None = None
    starvation_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    max_encode_images: int = 0


class SchedulableSeq(Protocol):
    """What the policy reads of a sequence."""

    @property
    def priority(self) -> int: ...        # lower is more important

    @property
    def arrival_time(self) -> float: ...

    @property
    def num_tokens(self) -> int: ...      # prompt + generated tokens known so far

    @property
    def num_computed_tokens(self) -> int: ...  # tokens whose KV is cached

    @property
    def offline(self) -> bool: ...        # best-effort work (service_tier flex): xllm.sched.colocation

    @property
    def encode_pending(self) -> int: ...  # images to encode before its prefill (xllm.sched.encode)


class SchedulerQueues(Protocol):
    """The engine scheduler as a batch policy sees it.

    ``running`` and ``waiting`` are read-only views in service order (``waiting``: priority, then
    arrival; a preempted sequence goes back to its front). The three operations change them:
    """

    @property
    def running(self) -> Sequence[SchedulableSeq]: ...

    @property
    def waiting(self) -> Sequence[SchedulableSeq]: ...

    def allocate(self, seq: SchedulableSeq, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more KV entries of running ``seq``; False (nothing
        changed) if memory is short."""
        ...

    def admit(self, seq: SchedulableSeq, max_new_tokens: int) -> int:
        """Move ``seq`` (of ``waiting``: :class:`DecodeFirstPolicy` takes its head, the co-location
        policy the first online one) to ``running``: give it KV memory, reusing a cached
        prefix (which may advance its ``num_computed_tokens``), with room for up to
        ``max_new_tokens`` of the rest. Returns how many tokens to compute this step, or 0 (nothing
        changed) if it cannot be admitted now."""
        ...

    def preempt(self, seq: SchedulableSeq) -> None:
        """Move running ``seq`` to the front of ``waiting``, releasing its KV; it will be recomputed."""
        ...


@dataclass(frozen=True)
class ScheduledChunk:
    seq: SchedulableSeq
    num_tokens: int


@dataclass
class StepPlan:
    """One step's decision. ``chunks`` lists decodes first, then prefill chunks."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    admitted: list[SchedulableSeq] = field(default_factory=list)
    preempted: list[SchedulableSeq] = field(default_factory=list)
    # why each of ``preempted`` was, in the same order: "kv" (memory) or "batch_full" (a sequence slot
    # for an online request; xllm.sched.colocation)
    preempt_reasons: list[str] = field(default_factory=list)
    # offline sequences that ran last step and are held out of this one for online work (their KV
    # stays: an interruption at a chunk boundary, not a preemption); co-location only
    interrupted: list[SchedulableSeq] = field(default_factory=list)
    # the longest time an offline sequence in the queues has gone without a chunk, seconds
    longest_offline_wait: float = 0.0
    # waiting sequences whose images the engine encodes this step (the encode phase: xllm.sched.encode)
    encodes: list[SchedulableSeq] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class BatchPolicy(Protocol):
    def schedule(self, queues: SchedulerQueues) -> StepPlan: ...


class BatchPolicyClass(Protocol):
    """What :data:`xllm.sched.BATCH_POLICIES` holds: a policy class built from :class:`BatchSettings`."""

    def from_settings(self, settings: BatchSettings) -> BatchPolicy: ...


class DecodeFirstPolicy:
    """Decode-first continuous batching with chunked prefill (see the module docstring)."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, chunked_prefill: bool = True,
                 max_encode_images: int = 0) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if max_encode_images < 0:
            raise ValueError(f"max_encode_images must be >= 0, got {max_encode_images}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.max_encode_images = max_encode_images

    @classmethod
    def from_settings(cls, settings: BatchSettings) -> DecodeFirstPolicy:
        """The policy for ``settings`` (it uses the slots, the token budget, chunking and the encode phase)."""
        return cls(settings.max_num_seqs, settings.max_num_batched_tokens, settings.chunked_prefill,
                   settings.max_encode_images)

    @staticmethod
    def victim_order(seq: SchedulableSeq) -> tuple[int, float]:
        """Sort key: the largest key is preempted first (lowest priority, latest arrival)."""
        return (seq.priority, seq.arrival_time)

    def schedule(self, queues: SchedulerQueues) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        running = list(queues.running)
        decodes = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in running if s.num_tokens - s.num_computed_tokens > 1]
        scheduled: set[int] = set()
        preempted: set[int] = set()
        for seq in decodes + prefills:
            if id(seq) in preempted:
                continue  # preempted earlier in this step
            need = seq.num_tokens - seq.num_computed_tokens
            n = min(need, budget) if self.chunked_prefill else need
            if n <= 0 or n > budget:
                continue
            while not queues.allocate(seq, n):
                victim = self._pick_victim(queues.running, scheduled, seq)
                queues.preempt(victim)
                preempted.add(id(victim))
                plan.preempted.append(victim)
                plan.preempt_reasons.append("kv")
                if victim is seq:
                    break
            else:
                plan.chunks.append(ScheduledChunk(seq, n))
                scheduled.add(id(seq))
                budget -= n
        if plan.preempted:
            return plan  # memory is short: admit nothing new this step
        encoding = self.max_encode_images > 0
        for seq in list(queues.waiting):
            if budget <= 0 or len(queues.running) >= self.max_num_seqs:
                break
            if encoding and seq.encode_pending:
                continue  # in its encode phase: not ready for prefill
            if not self.chunked_prefill and seq.num_tokens - seq.num_computed_tokens > budget:
                break  # without chunking the whole prompt must fit this step's budget
            n = queues.admit(seq, budget)
            if n < 1:
                break
            plan.admitted.append(seq)
            plan.chunks.append(ScheduledChunk(seq, n))
            budget -= n
        if encoding and not prefills:  # the encode phase: only while no prompt is mid-prefill
            plan.encodes = encodes_for_step(queues.waiting, self.max_encode_images,
                                            self.max_num_seqs - len(queues.running))
        return plan

    def _pick_victim(self, running: Sequence[SchedulableSeq], scheduled: set[int],
                     current: SchedulableSeq) -> SchedulableSeq:
        """The least important running sequence not yet scheduled this step, ``current``
        included: a sequence never evicts one that outranks it (it yields itself instead)."""
        candidates = [s for s in running if id(s) not in scheduled]
        if not candidates:
            return current
        return max(candidates, key=self.victim_order)
