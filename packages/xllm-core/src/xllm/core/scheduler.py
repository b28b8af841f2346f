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

With KV tiers below the engine's memory (:mod:`xllm.core.kv.lower_tiers`), a waiting sequence whose
prefix a lower tier holds goes to ``loading`` (status ``LOADING``) while its blocks come up on the
loader thread; steps go on without it. Once loaded, the blocks are in the prefix cache, held by the
load until the sequence's admission (which shares them), and the sequence is back in ``waiting``.

Not thread-safe: used from the engine's step loop only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable
from concurrent.futures import FIRST_COMPLETED, wait
from itertools import islice

from xllm.core.kv.contracts import KVAllocator
from xllm.core.kv.lower_tiers import LoadJob
from xllm.core.sequence import Phase, SeqStatus, Sequence
from xllm.sched import BatchPolicy, StepPlan


class Scheduler:
    """Queues, admission, preemption and KV lifetime of the engine's sequences.

    KV written by a forward that is still running (async scheduling) must not be released:
    :meth:`pin` names the sequences of the step in flight; a sequence that finishes meanwhile
    keeps its KV until :meth:`unpin`. Preemption never meets a pinned sequence: the engine lands
    the step in flight before a step that could preempt.

    The KV memory is held as its allocator contract (:class:`~xllm.core.kv.contracts.KVAllocator`):
    admission, growth, release and lower-tier loads, nothing of its tensors or pages.
    """

    def __init__(self, policy: BatchPolicy, kv: KVAllocator) -> None:
        self.policy = policy
        self.kv = kv
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.reserving: deque[Sequence] = deque()
        self.awaiting_kv: dict[str, Sequence] = {}
        self.handing_off: dict[str, Sequence] = {}
        self._pinned: frozenset[Sequence] = frozenset()
        self._release_after_unpin: list[Sequence] = []
        self.loading: dict[Sequence, LoadJob] = {}     # prefix coming up from a lower KV tier
        self._loaded: dict[Sequence, LoadJob] = {}     # back in waiting; the load holds its pages until admission
        self._orphan_loads: list[LoadJob] = []         # their sequence went away mid-load
        self._tier_checked: set[Sequence] = set()      # waiting sequences already looked up in the lower tiers

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
        self._tier_loads()
        plan = self.policy.schedule(_PolicyView(self, hold))
        if not plan and not self.running:
            self._yield_loads()
            if self.loading:  # an idle step: wait for a load rather than spin (the loader needs the GIL)
                wait([j.future for j in self.loading.values()], timeout=self.IDLE_LOAD_WAIT_S,
                     return_when=FIRST_COMPLETED)
        for seq in plan.admitted:
            seq.status = SeqStatus.RUNNING
        return plan

    def _yield_loads(self) -> None:
        """Nothing runs and nothing was admitted, so no step will free a page: give back the loaded
        pages the waiting sequences behind the head hold (their blocks stay in the prefix cache,
        evictable), or the head's remaining prompt may never fit beside them (seen live: requests
        stalled until the gateway's idle timeout). They stay looked up: not loaded again while they
        wait."""
        if not self._loaded:
            return
        head = self.waiting[0] if self.waiting else None
        for seq in [s for s in self._loaded if s is not head]:
            self.kv.release_load(self._loaded.pop(seq))

    # ---- lower KV tiers ---------------------------------------------------------------------------
    MAX_TIER_CHECKS = 16  # waiting sequences (from the head) looked up in the lower tiers per step
    IDLE_LOAD_WAIT_S = 0.1  # with nothing else to run, how long a step waits for a load to land

    def _tier_loads(self) -> None:
        """Start loads for waiting sequences whose prefix a lower tier holds, then land the done loads
        (their sequences back to ``waiting``). With nothing else to run, wait briefly for a load first,
        so a lone request's load lands in this step rather than after an idle pause."""
        if not self.loading and not self._orphan_loads and not (self.kv.has_tiers and self._may_load()):
            return
        for seq in list(islice(self.waiting, self.MAX_TIER_CHECKS)):
            if seq in self._tier_checked or seq.kv_pages:
                continue
            job = self.kv.begin_load(seq)
            if job is None:
                self._tier_checked.add(seq)
                continue
            self.waiting.remove(seq)
            seq.status = SeqStatus.LOADING
            self.loading[seq] = job
        if self.loading and not (self.running or self.waiting or self.reserving):
            wait([j.future for j in self.loading.values()], timeout=self.IDLE_LOAD_WAIT_S,
                 return_when=FIRST_COMPLETED)
        for job in [j for j in self._orphan_loads if j.done]:
            self._orphan_loads.remove(job)
            self.kv.end_load(job)
            self.kv.release_load(job)
        for seq, job in [(s, j) for s, j in self.loading.items() if j.done]:
            del self.loading[seq]
            if job.pages:
                self.kv.end_load(job)
                self._loaded[seq] = job
                self._tier_checked.add(seq)
            self.add(seq)  # a job without pages waited for another's load: looked up again next step

    def _may_load(self) -> bool:
        return any(s not in self._tier_checked for s in islice(self.waiting, self.MAX_TIER_CHECKS))

    def _forget_load(self, seq: Sequence) -> None:
        """``seq`` leaves the waiting side: drop what its lower-tier load held."""
        self._tier_checked.discard(seq)
        job = self._loaded.pop(seq, None)
        if job is not None:
            self.kv.release_load(job)
        job = self.loading.pop(seq, None)
        if job is not None:
            self._orphan_loads.append(job)  # the loader still writes its pages: released once done

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues for good (finished or aborted) and release its KV (after
        the step in flight, if that step writes it)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._forget_load(seq)
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

    def all_decoding(self) -> bool:
        """Nothing waits and every running sequence computes one token per step (no prompt left)."""
        return not self.waiting and all(s.num_tokens - s.num_computed_tokens <= 1 for s in self.running)

    def request_ids(self) -> list[str]:
        """The requests running, then those waiting (in queue order)."""
        return [s.request_id for s in (*self.running, *self.waiting)]

    def has_work(self) -> bool:
        """Anything a step could do (sequences awaiting their KV or handing it off wait for others;
        loads from lower tiers are landed by steps)."""
        return bool(self.running or self.waiting or self.reserving or self.loading or self._orphan_loads)

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

    def park_for_beams(self, seq: Sequence) -> None:
        """A beam request's prompt is computed: it leaves ``running`` (never scheduled nor preempted
        again) and keeps its KV, which its beams read until :meth:`finish` (xllm.core.beam)."""
        if any(s is seq for s in self.running):
            self.running.remove(seq)
        seq.status = SeqStatus.BEAM_SEARCH

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

    def pending_prefill_tokens(self) -> tuple[int, int]:
        """Prompt tokens still to compute — queued requests plus running ones mid-prefill — and the
        offline (co-location) share of them, in one pass."""
        total = offline = 0
        for seq in self.waiting:
            n = max(seq.num_tokens - seq.num_computed_tokens, 0)
            total += n
            offline += n if seq.offline else 0
        for seq in self.running:
            n = seq.num_tokens - seq.num_computed_tokens
            if n > 1:
                total += n
                offline += n if seq.offline else 0
        return total, offline

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
            self._forget_load(seq)  # its admission shares the loaded blocks now
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self._tier_checked.discard(seq)  # its blocks may be in a lower tier by now


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
