"""The engine's per-step batch policy: which tokens of which sequences run next.

Decode first, then chunked prefill under a token budget (xLLM §4.1, SARATHI
style): every running sequence that is decoding gets its one token, then
partially prefilled sequences continue, then waiting sequences are admitted in
(priority, arrival) order while budget, sequence slots and KV memory last.
When KV memory runs out for a running sequence, the lowest-priority, latest
arrived running sequence is preempted (its KV released, to be recomputed).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol


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


class KVAllocator(Protocol):
    """KV memory as the policy sees it."""

    def admit(self, seq: SchedulableSeq, max_new_tokens: int) -> int:
        """Give a waiting ``seq`` KV memory: reuse any cached prefix (which may advance
        ``seq.num_computed_tokens``), then make room for up to ``max_new_tokens`` of the
        rest. Returns how many tokens to compute this step, or 0 (and changes nothing)
        if it cannot be admitted now."""
        ...

    def allocate(self, seq: SchedulableSeq, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more KV entries of ``seq``; False if it cannot."""
        ...

    def free(self, seq: SchedulableSeq) -> None:
        """Release all of ``seq``'s KV memory."""
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

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class BatchPolicy(Protocol):
    def schedule(self, running: list, waiting: deque, kv: KVAllocator) -> StepPlan: ...


class DecodeFirstPolicy:
    """Decode-first continuous batching with chunked prefill.

    :meth:`schedule` mutates its arguments: admitted sequences move from the
    front of ``waiting`` to the end of ``running``; preempted ones move from
    ``running`` to the front of ``waiting`` (after their KV is freed through
    ``kv.free``). ``waiting`` must already be in service order.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, chunked_prefill: bool = True) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill

    @staticmethod
    def victim_order(seq: SchedulableSeq) -> tuple[int, float]:
        """Sort key: the largest key is preempted first (lowest priority, latest arrival)."""
        return (seq.priority, seq.arrival_time)

    def schedule(self, running: list, waiting: deque, kv: KVAllocator) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        decodes = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in running if s.num_tokens - s.num_computed_tokens > 1]
        scheduled: set[int] = set()
        for seq in decodes + prefills:
            if not any(s is seq for s in running):
                continue  # preempted earlier in this step
            need = seq.num_tokens - seq.num_computed_tokens
            n = min(need, budget) if self.chunked_prefill else need
            if n <= 0 or n > budget:
                continue
            while not kv.allocate(seq, n):
                victim = self._pick_victim(running, scheduled, seq)
                self._preempt(victim, running, waiting, kv, plan)
                if victim is seq:
                    break
            else:
                plan.chunks.append(ScheduledChunk(seq, n))
                scheduled.add(id(seq))
                budget -= n
        if plan.preempted:
            return plan  # memory is short: admit nothing new this step
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            seq = waiting[0]
            if not self.chunked_prefill and seq.num_tokens - seq.num_computed_tokens > budget:
                break  # without chunking the whole prompt must fit this step's budget
            n = kv.admit(seq, budget)
            if n < 1:
                break
            waiting.popleft()
            running.append(seq)
            plan.admitted.append(seq)
            plan.chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return plan

    def _pick_victim(self, running: list, scheduled: set[int], current: SchedulableSeq) -> SchedulableSeq:
        """The least important running sequence not yet scheduled this step, ``current``
        included: a sequence never evicts one that outranks it (it yields itself instead)."""
        candidates = [s for s in running if id(s) not in scheduled]
        if not candidates:
            return current
        return max(candidates, key=self.victim_order)

    @staticmethod
    def _preempt(seq, running: list, waiting: deque, kv: KVAllocator, plan: StepPlan) -> None:
        kv.free(seq)
        running.remove(seq)
        waiting.appendleft(seq)
        plan.preempted.append(seq)
