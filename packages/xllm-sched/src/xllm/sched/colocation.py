"""Online/offline co-location in one engine (xLLM §3.1): offline requests fill the capacity online
requests leave, and give it back the moment online requests need it.

A sequence is *offline* when it says so (``seq.offline``: the API's ``service_tier: "flex"`` or a
priority at or above the gateway's ``--offline-priority``). :class:`ColocationPolicy` decides one step:

1. **Online sequences are scheduled exactly as** :class:`~xllm.sched.batch_policy.DecodeFirstPolicy`
   **would**: their decodes, then their partial prefills, then online admissions in (priority,
   arrival) order, under the token budget; with no offline sequence in the queues the decisions are
   identical. Offline sequences are invisible to them except as preemption victims (below).
2. **Offline sequences fill what is left**, after every online chunk: their decodes, then their
   partial prefills (chunked: a prefill is interrupted at any chunk boundary, keeping the KV of
   what it computed), then offline admissions. With a TPOT SLO (``slo_tpot_s``) and a step-time
   predictor (``predict``), offline rows and chunks join a step only while its predicted time stays
   within a *cap* (largest chunk that fits, by bisection: ``predict`` must not decrease as a chunk
   grows). An online request's TPOT is the average of the steps it decodes in, and the steps that
   carry online prefill chunks run long whatever offline work does, so the cap is set on that
   average: the policy keeps the predicted times of the online part of the last ``window_steps``
   steps with online decode rows (their *bases*, this step's included), and the cap is the largest
   ``c`` with mean(max(base, c)) ≤ ``slo_fraction`` × the SLO (:func:`average_cap`): at light load
   the cap is ``slo_fraction`` × the SLO itself; the more online prefill there is, the less offline
   work joins the other steps; none while the bases alone average above the target. A cap on each
   step alone (filling every step to the SLO) met the SLO for 8.5 % of online requests in a
   200-instance simulation, whose online-only run met it for 99.5 %.

   The window holds the instance's *average*; an online request's TPOT is the average of *its own*
   steps, and those differ: online prompts arrive in bursts, and a request decoding through one sees
   many steps that carry online prefill chunks (each ~0.4 s on this machine's profile, the objective
   0.17 s). Two more rules protect the requests themselves:

   - **Each request's running average.** The policy keeps, per online sequence, the predicted time
     of the steps it decoded in and their count (its *life*). A step carrying its decode row may
     take offline work only up to ``target``·(steps + 1) − seconds so far: a request that fell
     behind the target (a burst of online prefill hit it) decodes in steps without offline work
     until it is back on it — however low the window's average. (Averages over the window hid
     exactly these requests: their offline share was 11 ms per token of 218, the rest their own
     online prefill exposure — 43 % of their steps — against 6 % in an online-only run: offline
     work lengthens every step, so a request lives longer and sees more online bursts; see
     docs/architecture.md, "Cluster simulator".)
   - **The instance's recent attainment.** When an online sequence's life ends (finished, aborted or
     moved), its predicted TPOT (seconds over steps) is compared with the SLO: a miss scales the
     offline target of this instance by ``miss_backoff``, a met one gives back ``meet_regain`` of
     it (additive, up to 1). At equilibrium about regain / (regain + ln(1/backoff)) of the
     finishing online requests miss, so an instance whose online load alone runs near the SLO
     takes little offline work, one with room takes the full target.

   So the cap of a step is the smallest of: the window's (at ``slo_fraction`` × the SLO × the
   attainment scale) and each online decode row's. Without an SLO or a predictor, or while
   ``predict`` returns ``None`` (no model yet), offline work takes only what online work leaves of
   the token budget and the sequence slots. The SLO cap applies while any online sequence is
   running or waiting; with none, offline work takes the whole step.
3. **Preemption** (the victim's KV is released; it goes back to the front of ``waiting`` and is
   recomputed from its prompt and the output it already has, so no token is lost):

   - ``kv``: a sequence needs KV memory: victims are the unscheduled running sequences, offline ones
     first (non-starved before starved), then online ones by (priority, arrival) as DecodeFirstPolicy
     picks them; offline work never evicts an online sequence (it yields itself). As in
     DecodeFirstPolicy a step that had to preempt an *online* sequence admits nothing new; evicting
     offline work holds no online admission back.
   - ``batch_full``: an online request is waiting and ``max_num_seqs`` sequences run: an unscheduled
     offline sequence is preempted to free its slot (vLLM's priority scheduling preempts only under
     KV pressure, so a batch full of offline decodes would block online admissions).

   An offline sequence that ran last step and is held out of this one (its budget or SLO room went to
   online work) is *interrupted*, not preempted: its KV stays (``StepPlan.interrupted``; the engine
   counts it under the reason ``slo``).
4. **Starvation bound.** An offline sequence's *wait* is the time since the policy last scheduled a
   chunk of it (or first saw it). Once the wait reaches ``starvation_s`` the sequence is *starved*,
   and each step serves the ``starved_per_step`` longest-starved sequences first, before any online
   chunk and regardless of the SLO: one decode row, or a prefill chunk of at most
   ``starved_chunk_tokens`` (less where the online decode rows would otherwise not fit the token
   budget); a starved waiting sequence is admitted if a slot is free or one can be
   freed from a non-starved offline sequence. It may evict offline sequences for KV, never online ones.
   **Bound:** with ``starved_per_step`` = 1, a starved running sequence is scheduled within k steps of
   becoming starved, k being its rank by wait among the starved sequences (the first step if it is the
   only one); a starved waiting sequence likewise, provided online sequences alone do not hold every
   slot or all KV memory. So no offline sequence goes without progress for more than ``starvation_s``
   plus those steps; the exception (an online load that occupies the whole engine) is the one in
   which online SLOs come first, and ``StepPlan.longest_offline_wait`` (the engine's
   ``xllm:offline_longest_wait_seconds``) shows it.

5. **The encode phase** of multimodal requests (``max_encode_images`` > 0; :mod:`xllm.sched.encode`): a
   sequence with images still to encode is passed over by every admission (online, offline, starved), and
   the step encodes the images of waiting sequences (online first) only while no online prompt is
   mid-prefill.

Pure logic, no torch; the engine and the cluster simulator run the same code.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from xllm.sched.batch_policy import (
    DEFAULT_OFFLINE_SLO_FRACTION,
    BatchSettings,
    SchedulableSeq,
    ScheduledChunk,
    SchedulerQueues,
    StepPlan,
)
from xllm.sched.encode import encodes_for_step
from xllm.sched.latency import StepShape
from xllm.sched.latency import is_decode_row as _is_decode_row

Predict = Callable[[StepShape], float | None]


DEFAULT_MISS_BACKOFF = 0.8
"""Share of its offline target an instance keeps after an online request missed the TPOT SLO."""
DEFAULT_MEET_REGAIN = 0.01
"""Share of the offline target an instance regains per online request that met it (with the backoff:
about 4 % of its online requests may miss before the target shrinks)."""


@dataclass
class _Life:
    """One online sequence's decode life as the policy planned it: predicted seconds of the steps it
    decoded in, and how many (the engine's steps, not their measured times)."""

    seq: SchedulableSeq
    seconds: float = 0.0
    steps: int = 0


def average_cap(bases: list[float], target: float) -> float:
    """The largest ``c`` ≥ 0 with mean(max(b, c) for b in ``bases``) ≤ ``target``: how long a step may
    be made by adding work to it, given the steps' own times ``bases``, for their average to stay
    within ``target`` (0 when the bases alone exceed it). O(n log n)."""
    ordered = sorted(bases)
    n = len(ordered)
    if not n:
        return target
    above = 0.0  # sum of the bases above the k lowest
    for k in range(n, 0, -1):
        c = (n * target - above) / k  # the k lowest raised to c, the rest as they are
        if c >= ordered[k - 1]:
            return max(c, 0.0)
        above += ordered[k - 1]
    return 0.0


@dataclass
class _Step:
    """One ``schedule`` call's working state."""

    queues: SchedulerQueues
    budget: int
    starved: set[int]
    plan: StepPlan = field(default_factory=StepPlan)
    chunks: list[tuple[SchedulableSeq, int]] = field(default_factory=list)
    shape: StepShape = field(default_factory=StepShape)  # step_shape(chunks), kept as chunks are added
    scheduled: set[int] = field(default_factory=set)
    preempted: set[int] = field(default_factory=set)

    def add(self, seq: SchedulableSeq, n: int) -> None:
        self.shape = self.shape.with_chunk(seq, n)  # before the chunk is computed, as step_shape reads it
        self.chunks.append((seq, n))
        self.scheduled.add(id(seq))
        self.budget -= n

    def preempt(self, victim: SchedulableSeq, reason: str) -> None:
        self.queues.preempt(victim)
        self.preempted.add(id(victim))
        self.plan.preempted.append(victim)
        self.plan.preempt_reasons.append(reason)

    def is_running(self, seq: SchedulableSeq) -> bool:
        return any(s is seq for s in self.queues.running)


class ColocationPolicy:
    """Online work as DecodeFirstPolicy schedules it, offline work in what it leaves, within the
    TPOT SLO by prediction; offline preempted for online KV and slots; starvation bounded (see the
    module docstring for every rule)."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, chunked_prefill: bool = True,
                 slo_tpot_s: float | None = None, predict: Predict | None = None, starvation_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, starved_chunk_tokens: int = 16,
                 starved_per_step: int = 1, slo_fraction: float = DEFAULT_OFFLINE_SLO_FRACTION,
                 window_steps: int = 128, miss_backoff: float = DEFAULT_MISS_BACKOFF,
                 meet_regain: float = DEFAULT_MEET_REGAIN, max_encode_images: int = 0) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if slo_tpot_s is not None and not slo_tpot_s > 0:
            raise ValueError(f"slo_tpot_s must be > 0, got {slo_tpot_s}")
        if not 0 < slo_fraction <= 1:
            raise ValueError(f"slo_fraction must be in (0, 1], got {slo_fraction}")
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        if not 0 <= miss_backoff <= 1 or not 0 <= meet_regain <= 1:
            raise ValueError(f"miss_backoff and meet_regain must be in [0, 1], got {miss_backoff}, {meet_regain}")
        if not starvation_s > 0 or starved_chunk_tokens < 1 or starved_per_step < 1:
            raise ValueError("starvation_s must be > 0, starved_chunk_tokens and starved_per_step >= 1")
        if max_encode_images < 0:
            raise ValueError(f"max_encode_images must be >= 0, got {max_encode_images}")
        self.max_encode_images = max_encode_images
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.slo_tpot_s = slo_tpot_s
        self.slo_fraction = slo_fraction
        self.predict = predict
        self.starvation_s = starvation_s
        self.clock = clock
        self.starved_chunk_tokens = starved_chunk_tokens
        self.starved_per_step = starved_per_step
        self._progress: dict[int, tuple[SchedulableSeq, float]] = {}  # offline: last chunk (or first seen)
        self._ran_last: dict[int, SchedulableSeq] = {}                # offline sequences of the last plan
        self._bases: deque[float] = deque(maxlen=window_steps)        # predicted online parts of recent steps
        self._lives: dict[int, _Life] = {}                            # online sequences in the queues
        self.miss_backoff, self.meet_regain = miss_backoff, meet_regain
        self.attainment_scale = 1.0  # the share of the offline target the instance's online misses leave

    @classmethod
    def from_settings(cls, settings: BatchSettings) -> ColocationPolicy:
        """The policy for an engine's (or a simulated instance's) ``settings``."""
        return cls(settings.max_num_seqs, settings.max_num_batched_tokens, settings.chunked_prefill,
                   slo_tpot_s=settings.slo_tpot_s, predict=settings.predict, starvation_s=settings.starvation_s,
                   clock=settings.clock, slo_fraction=settings.offline_slo_fraction,
                   max_encode_images=settings.max_encode_images)

    # ---- the decision ---------------------------------------------------------------------------
    def schedule(self, queues: SchedulerQueues) -> StepPlan:
        now = self.clock()
        running = list(queues.running)
        waiting = list(queues.waiting)
        starved, present = self._track(running + waiting, now)
        self._end_lives(present)
        step = _Step(queues, self.max_num_batched_tokens, {id(s) for s in starved})
        self._serve_starved(step, starved, running)
        self._online_running(step, running)
        # memory is short for online work: nothing new this step (as DecodeFirstPolicy); offline work
        # preempted to make room is co-location as usual and holds no online request back
        if not any(not s.offline for s in step.plan.preempted):
            self._online_admissions(step)
        cap = self._cap(step, running, waiting)
        self._offline_running(step, running, cap)
        if not step.plan.preempted:
            self._offline_admissions(step, cap)
        if self.max_encode_images and not any(not s.offline and s.num_tokens - s.num_computed_tokens > 1
                                              for s in running):
            step.plan.encodes = encodes_for_step(queues.waiting, self.max_encode_images,
                                                 self.max_num_seqs - len(queues.running))
        return self._finish(step, now)

    def _encoding(self, seq: SchedulableSeq) -> bool:
        """``seq`` is in its encode phase (not ready for prefill)."""
        return self.max_encode_images > 0 and seq.encode_pending > 0

    def _track(self, seqs: list[SchedulableSeq],
               now: float) -> tuple[list[SchedulableSeq], dict[int, SchedulableSeq]]:
        """Refresh the wait clocks of the offline sequences in the queues; the starved ones, longest
        wait first, and the online sequences in the queues that have a life (one pass)."""
        progress: dict[int, tuple[SchedulableSeq, float]] = {}
        present: dict[int, SchedulableSeq] = {}
        lives = self._lives
        for seq in seqs:
            if seq.offline:
                known = self._progress.get(id(seq))
                progress[id(seq)] = known if known is not None and known[0] is seq else (seq, now)
            elif id(seq) in lives:
                present[id(seq)] = seq
        self._progress = progress
        starved = [(t, s.priority, s.arrival_time, s) for s, t in progress.values() if now - t >= self.starvation_s]
        starved.sort(key=lambda e: e[:3])
        return [e[3] for e in starved], present

    def _end_lives(self, present: dict[int, SchedulableSeq]) -> None:
        """Drop the lives of online sequences no longer in the queues (``present``: those that are,
        running or waiting — a preempted one resumes its life); each one that decoded is an
        observation of the attainment scale (module docstring)."""
        lives = self._lives
        for key in [k for k, life in lives.items() if present.get(k) is not life.seq]:
            life = lives.pop(key)
            if life.steps:
                if life.seconds / life.steps > self.slo_tpot_s:
                    self.attainment_scale *= self.miss_backoff
                else:
                    self.attainment_scale = min(self.attainment_scale + self.meet_regain, 1.0)

    def _cap(self, step: _Step, running: list[SchedulableSeq], waiting: list[SchedulableSeq]) -> float | None:
        """Seconds the predicted step may take with offline work in it (``None``: no cap — no SLO, no
        predictor or no prediction yet, or no online work to protect). The step's online part (its
        *base*) joins the window of recent bases when it has online decode rows; the cap is the
        largest ``c`` with mean(max(base, c)) over the window ≤ the target (``slo_fraction`` × the SLO
        × the attainment scale), and no more than keeps each online decode row's own running average
        within the target."""
        if self.slo_tpot_s is None or self.predict is None or all(s.offline for s in running + waiting):
            return None
        base = self.predict(step.shape) if step.chunks else 0.0
        if base is None:
            return None
        rows = [s for s, n in step.chunks if not s.offline and _is_decode_row(s, n)]
        if rows:
            self._bases.append(base)
            window = list(self._bases)
        else:  # no online request's TPOT includes this step: the same rule, the window unchanged
            window = [*self._bases, base]
        target = self.slo_tpot_s * self.slo_fraction * self.attainment_scale
        cap = average_cap(window, target)
        for seq in rows:
            life = self._lives.get(id(seq))
            if life is not None and life.seq is seq:
                cap = min(cap, target * (life.steps + 1) - life.seconds)
        return cap

    def _live(self, step: _Step) -> None:
        """Add this step's predicted time to the life of each online sequence decoding in it."""
        rows = [s for s, n in step.chunks if not s.offline and _is_decode_row(s, n)]
        seconds = self.predict(step.shape) if rows else None
        if seconds is None:
            return
        for seq in rows:
            life = self._lives.get(id(seq))
            if life is None or life.seq is not seq:
                life = self._lives[id(seq)] = _Life(seq)
            life.seconds += seconds
            life.steps += 1

    # ---- phases ----------------------------------------------------------------------------------
    def _serve_starved(self, step: _Step, starved: list[SchedulableSeq], running: list[SchedulableSeq]) -> None:
        # the share leaves the budget room for the online decode rows (a decode row itself always fits)
        online_rows = sum(1 for s in running if not s.offline and s.num_tokens - s.num_computed_tokens == 1)
        served = 0
        for seq in starved:
            if served >= self.starved_per_step or step.budget <= 0:
                return
            if id(seq) in step.preempted:
                continue
            need = seq.num_tokens - seq.num_computed_tokens
            room = max(1, step.budget - online_rows)
            limit = self._chunk(need, min(self.starved_chunk_tokens, room) if self.chunked_prefill else room)
            if step.is_running(seq):
                if limit and self._allocate(step, seq, limit, evict_online=False):
                    step.add(seq, limit)
                    served += 1
            elif (limit and not self._encoding(seq) and self._make_slot(step, starved_ok=False)
                  and self._admit(step, seq, limit, evict=True)):
                served += 1

    def _online_running(self, step: _Step, running: list[SchedulableSeq]) -> None:
        online = [s for s in running if not s.offline]
        decodes = [s for s in online if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in online if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if id(seq) in step.preempted:
                continue
            need = seq.num_tokens - seq.num_computed_tokens
            n = min(need, step.budget) if self.chunked_prefill else need
            if n <= 0 or n > step.budget:
                continue
            if self._allocate(step, seq, n, evict_online=True):
                step.add(seq, n)

    def _online_admissions(self, step: _Step) -> None:
        for seq in [s for s in step.queues.waiting if not s.offline]:
            if step.budget <= 0:
                return
            if self._encoding(seq):
                continue
            if len(step.queues.running) >= self.max_num_seqs and not self._make_slot(step, starved_ok=True):
                return
            if not self.chunked_prefill and seq.num_tokens - seq.num_computed_tokens > step.budget:
                return  # without chunking the whole prompt must fit this step's budget
            if not self._admit(step, seq, step.budget, evict=True):
                return

    def _offline_running(self, step: _Step, running: list[SchedulableSeq], cap: float | None) -> None:
        offline = sorted((s for s in running if s.offline and id(s) not in step.scheduled),
                         key=lambda s: (s.priority, s.arrival_time))
        decodes = [s for s in offline if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in offline if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if step.budget <= 0:
                return
            if id(seq) in step.preempted or not step.is_running(seq):
                continue
            need = seq.num_tokens - seq.num_computed_tokens
            n = self._fit(step, seq, self._chunk(need, step.budget), cap)
            if n and self._allocate(step, seq, n, evict_online=False):
                step.add(seq, n)

    def _offline_admissions(self, step: _Step, cap: float | None) -> None:
        for seq in [s for s in step.queues.waiting if s.offline and id(s) not in step.preempted]:
            if step.budget <= 0 or len(step.queues.running) >= self.max_num_seqs:
                return
            if self._encoding(seq):
                continue
            need = seq.num_tokens - seq.num_computed_tokens
            limit = self._fit(step, seq, self._chunk(need, step.budget), cap)
            if not limit or not self._admit(step, seq, limit, evict=False):
                return

    # ---- helpers ---------------------------------------------------------------------------------
    def _chunk(self, need: int, limit: int) -> int:
        """Tokens of a chunk of ``need`` within ``limit`` (0: none; unchunked: all or none)."""
        if need <= 0 or limit <= 0:
            return 0
        if self.chunked_prefill or need == 1:
            return min(need, limit)
        return need if need <= limit else 0

    def _fit(self, step: _Step, seq: SchedulableSeq, n: int, cap: float | None) -> int:
        """The largest chunk of ``seq`` up to ``n`` tokens whose step is predicted within ``cap``
        seconds (``n`` when there is no cap or no prediction; unchunked prefills: ``n`` or 0)."""
        if not n or cap is None:
            return n

        def fits(k: int) -> bool:
            seconds = self.predict(step.shape.with_chunk(seq, k))
            return seconds is None or seconds <= cap

        if fits(n):
            return n
        if not self.chunked_prefill or n == 1:
            return 0
        lo, hi = 0, n  # fits(lo) (or lo == 0), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    @staticmethod
    def victim_order(seq: SchedulableSeq, starved: set[int]) -> tuple[int, int, float]:
        """Sort key: the largest key is preempted first: offline before online (non-starved before
        starved), then DecodeFirstPolicy's order (lowest priority, latest arrival)."""
        rank = (1 if id(seq) in starved else 2) if seq.offline else 0
        return (rank, seq.priority, seq.arrival_time)

    def _allocate(self, step: _Step, seq: SchedulableSeq, n: int, evict_online: bool) -> bool:
        """KV for ``n`` more tokens of running ``seq``, preempting (reason ``kv``) the least important
        unscheduled sequence until it fits, ``seq`` itself included (then False); offline work never
        evicts online sequences."""
        while not step.queues.allocate(seq, n):
            candidates = [s for s in step.queues.running
                          if id(s) not in step.scheduled and (evict_online or s.offline)]
            victim = max(candidates, key=lambda s: self.victim_order(s, step.starved)) if candidates else seq
            step.preempt(victim, "kv")
            if victim is seq:
                return False
        return True

    def _make_slot(self, step: _Step, starved_ok: bool) -> bool:
        """A free sequence slot, preempting an unscheduled offline sequence (``batch_full``) if all
        are taken (starved ones only when ``starved_ok``); False if none can be freed."""
        if len(step.queues.running) < self.max_num_seqs:
            return True
        return self._evict_offline(step, "batch_full", starved_ok)

    def _evict_offline(self, step: _Step, reason: str, starved_ok: bool) -> bool:
        candidates = [s for s in step.queues.running if s.offline and id(s) not in step.scheduled
                      and (starved_ok or id(s) not in step.starved)]
        if not candidates:
            return False
        step.preempt(max(candidates, key=lambda s: self.victim_order(s, step.starved)), reason)
        return True

    def _admit(self, step: _Step, seq: SchedulableSeq, limit: int, evict: bool) -> bool:
        """Admit waiting ``seq`` with a first chunk of at most ``limit`` tokens; when KV is short and
        ``evict``, preempt offline sequences (``kv``; starved ones only for online work) until it fits."""
        while True:
            n = step.queues.admit(seq, limit)
            if n >= 1:
                step.plan.admitted.append(seq)
                step.add(seq, n)
                return True
            if not (evict and self._evict_offline(step, "kv", starved_ok=not seq.offline)):
                return False

    def _finish(self, step: _Step, now: float) -> StepPlan:
        plan = step.plan
        if self.slo_tpot_s is not None and self.predict is not None:
            self._live(step)
        decodes = [(s, n) for s, n in step.chunks if _is_decode_row(s, n)]
        prefills = [(s, n) for s, n in step.chunks if not _is_decode_row(s, n)]
        plan.chunks = [ScheduledChunk(s, n) for s, n in decodes + prefills]
        ran: dict[int, SchedulableSeq] = {}
        for seq, _ in step.chunks:
            if seq.offline:
                ran[id(seq)] = seq
                self._progress[id(seq)] = (seq, now)
        running = step.queues.running
        plan.interrupted = [s for k, s in self._ran_last.items()
                            if k not in ran and k not in step.preempted and any(r is s for r in running)
                            and s.num_tokens > s.num_computed_tokens]
        self._ran_last = ran
        plan.longest_offline_wait = max((now - t for _, t in self._progress.values()), default=0.0)
        return plan
