"""The engine's request queues and everything that moves sequences between them.

:class:`Scheduler` owns ``waiting`` (in service order: priority, then arrival) and ``running``,
admission (KV memory, prefix reuse), the whole of preemption (KV release, back to the front of
``waiting``, progress reset, status) and when a finished sequence's KV is released. Which
sequences run next is decided by a batch policy from :mod:`xllm.sched` (pure logic, no torch),
which sees the scheduler through :class:`xllm.sched.SchedulerQueues`.

Disaggregated requests (see :mod:`xllm.core.disagg`) have three more places: ``reserving`` (decode
side, waiting for KV memory for the prompt), ``awaiting_kv`` (decode side, reserved, the prompt's KV
on its way) and ``handing_off`` (prefill side, first token out, KV held for the transfer). Sequences
there hold KV but take no part in steps.

Not thread-safe: used from the engine's step loop only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable

from xllm.core.kv.base import KVCacheBackend
from xllm.core.sequence import Phase, SeqStatus, Sequence
from xllm.sched import BatchPolicy, StepPlan


class Scheduler:
    """Queues, admission, preemption and KV lifetime of the engine's sequences.

    KV written by a forward that is still running (async scheduling) must not be released:
    :meth:`pin` names the sequences of the step in flight; a sequence that finishes meanwhile
    keeps its KV until :meth:`unpin`. Preemption never meets a pinned sequence: the engine lands
    the step in flight before a step that could preempt.
    """

    def __init__(self, policy: BatchPolicy, kv: KVCacheBackend) -> None:
        self.policy = policy
        self.kv = kv
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.reserving: deque[Sequence] = deque()
        self.awaiting_kv: dict[str, Sequence] = {}
        self.handing_off: dict[str, Sequence] = {}
        self._pinned: frozenset[Sequence] = frozenset()
        self._release_after_unpin: list[Sequence] = []

    # ---- queues -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence in (priority, arrival) order (a decode-phase one: for a KV reservation)."""
        if seq.phase is Phase.DECODE:
            seq.status = SeqStatus.RESERVING
            self.reserving.append(seq)
            return
        seq.status = SeqStatus.WAITING
        key = (seq.priority, seq.arrival_time)
        idx = len(self.waiting)
        while idx > 0 and (self.waiting[idx - 1].priority, self.waiting[idx - 1].arrival_time) > key:
            idx -= 1
        self.waiting.insert(idx, seq)

    def schedule(self, hold: Collection[Sequence] = ()) -> StepPlan:
        """Let the policy pick this step's chunks; sequences in ``hold`` (async scheduling: their
        last token is already in flight) are neither scheduled nor counted as running."""
        plan = self.policy.schedule(_PolicyView(self, hold))
        for seq in plan.admitted:
            seq.status = SeqStatus.RUNNING
        return plan

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues for good (finished or aborted) and release its KV (after
        the step in flight, if that step writes it)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if any(s is seq for s in self.running):
            self.running.remove(seq)
        if seq in self.reserving:
            self.reserving.remove(seq)
        self.awaiting_kv.pop(seq.request_id, None)
        self.handing_off.pop(seq.request_id, None)
        seq.status = SeqStatus.FINISHED
        if seq in self._pinned:
            self._release_after_unpin.append(seq)
        else:
            self.kv.free(seq)

    def has_work(self) -> bool:
        """Anything a step could do (sequences awaiting their KV or handing it off wait for others)."""
        return bool(self.running or self.waiting or self.reserving)

    @property
    def num_holding_kv(self) -> int:
        """Sequences with KV memory: running, and those on either side of a hand-off."""
        return len(self.running) + len(self.awaiting_kv) + len(self.handing_off)

    # ---- prefill/decode hand-offs ----------------------------------------------------------------
    def reserve(self, max_seqs: int) -> list[Sequence]:
        """Give decode-phase sequences (in arrival order) KV memory for their whole prompt, reusing
        the local prefix cache, while ``max_seqs`` sequences hold KV at most and memory lasts."""
        reserved = []
        while self.reserving and self.num_holding_kv < max_seqs:
            seq = self.reserving[0]
            if self.kv.admit(seq, seq.num_tokens) < 1:
                break
            self.reserving.popleft()
            seq.status = SeqStatus.AWAITING_KV
            self.awaiting_kv[seq.request_id] = seq
            reserved.append(seq)
        return reserved

    def resume_with_kv(self, seq: Sequence) -> None:
        """A reserved sequence has its prompt's KV (or will recompute what it lacks): it runs."""
        del self.awaiting_kv[seq.request_id]
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def hand_off(self, seq: Sequence) -> None:
        """A prefill-phase sequence sampled its first token: it stops running, its KV stays."""
        self.running.remove(seq)
        seq.status = SeqStatus.HANDING_OFF
        self.handing_off[seq.request_id] = seq

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: queued requests plus running ones mid-prefill."""
        pending = sum(max(seq.num_tokens - seq.num_computed_tokens, 0) for seq in self.waiting)
        return pending + sum(seq.num_tokens - seq.num_computed_tokens for seq in self.running
                             if seq.num_tokens - seq.num_computed_tokens > 1)

    # ---- KV lifetime across a step in flight ------------------------------------------------------
    def pin(self, seqs: Iterable[Sequence]) -> None:
        """The KV of ``seqs`` is being written by the step in flight."""
        self._pinned = frozenset(seqs)

    def unpin(self) -> None:
        """The step in flight landed: release the KV of sequences that finished meanwhile."""
        self._pinned = frozenset()
        released, self._release_after_unpin = self._release_after_unpin, []
        for seq in released:
            self.kv.free(seq)

    # ---- the operations a policy asks for (xllm.sched.SchedulerQueues) -----------------------------
    def _admit(self, seq: Sequence, max_new_tokens: int) -> int:
        n = self.kv.admit(seq, max_new_tokens)
        if n > 0:
            self.waiting.remove(seq)
            self.running.append(seq)
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1


class _PolicyView:
    """:class:`xllm.sched.SchedulerQueues` over a :class:`Scheduler`, for one ``schedule`` call."""

    def __init__(self, scheduler: Scheduler, hold: Collection[Sequence]) -> None:
        self._s = scheduler
        self._hold = hold

    @property
    def running(self) -> list[Sequence]:
        if not self._hold:
            return self._s.running
        return [s for s in self._s.running if s not in self._hold]

    @property
    def waiting(self) -> deque[Sequence]:
        return self._s.waiting

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._s.kv.allocate(seq, num_new_tokens)

    def admit(self, seq: Sequence, max_new_tokens: int) -> int:
        return self._s._admit(seq, max_new_tokens)

    def preempt(self, seq: Sequence) -> None:
        self._s._preempt(seq)
