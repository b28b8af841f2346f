"""One simulated engine instance: the engine scheduler's queues and KV memory, with the real batch
policy of ``xllm.sched`` deciding every step.

:class:`SimInstance` is the engine's ``Scheduler`` without tensors: it implements
:class:`xllm.sched.SchedulerQueues` (``running``, ``waiting``, ``allocate``, ``admit``, ``preempt``,
with the same semantics: admission reuses a cached prefix, preemption releases KV and requeues at
the front of ``waiting`` with progress reset) over a :class:`~xllm.sim.kvcache.SimKV`, plus the PD
queues (``reserving``, ``awaiting``, ``handing_off``). A step is planned by the policy
(:meth:`start_step`), lasts what the step-time model predicts for its shape (the shape is read as
``xllm.core.step_timing.step_shape`` reads it), and lands in :meth:`finish_step`: computed tokens
advance, full blocks enter the prefix cache, every sequence that computed all its known tokens
samples one, finished ones leave and release their KV, PD prefills stop at their first token and
keep their KV for the hand-off. Images (``encode_pending``): a step encoding ``k`` images lasts ``k`` ×
``encode_image_s`` longer, in the policy's encode phase (``StepPlan.encodes``) or, with the phase off, in the
step of the request's first prefill chunk (as the engine's eager path encodes them). EPD (``e+p+d``, ``ed+p``):
an instance also encodes other instances' requests (:meth:`add_encode_job`, the engine's ``Encode`` calls); as
the engine runs the calls queued between two steps, each step takes every queued job (its images' encode time
added to the step, a step of its own when nothing else runs), and :meth:`finish_step` returns them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from xllm.sched import BatchPolicy, ScheduledChunk
from xllm.sched.latency import StepShape, StepTimeModel
from xllm.sim.kvcache import KVSeq, SimKV

MIXED, PREFILL, DECODE = "mixed", "prefill", "decode"  # a sequence's phase on an instance, and instance roles
ENCODE = "encode"  # the role of an instance that only encodes other instances' images (EPD e+p+d)


class SimSeq(KVSeq):
    """One request on one instance (a PD request has a prefill-phase one on P and a decode-phase one
    on D). Satisfies ``xllm.sched.SchedulableSeq`` (and ``offline`` for co-location policies;
    ``encode_pending``: its images not encoded yet)."""

    __slots__ = ("arrival_time", "encode_pending", "generated", "offline", "output_len", "phase", "preemptions",
                 "priority", "prompt_len", "req")

    def __init__(self, req, phase: str = MIXED, generated: int = 0) -> None:
        spec = req.spec
        super().__init__(spec.rid, spec.prefix_group, spec.prefix_len // req.block_size,
                         spec.prompt_len + generated)
        self.req = req
        self.prompt_len = spec.prompt_len
        self.output_len = spec.output_len
        self.offline = spec.offline
        # (a decode side gets the prompt's KV; EPD: the images were encoded on another instance)
        self.encode_pending = spec.images if phase != DECODE and not req.encoded else 0
        self.priority = req.priority
        self.arrival_time = spec.arrival
        self.phase = phase
        self.generated = generated
        self.preemptions = 0

    def __repr__(self) -> str:
        return f"SimSeq(r{self.rid} {self.phase} {self.num_computed_tokens}/{self.num_tokens})"


@dataclass
class StepResult:
    """What a step produced: sequences that sampled their request's first token, sequences that are
    done here (finished, or a PD prefill at its first token), and every sequence that sampled."""

    first: list[SimSeq] = field(default_factory=list)
    done: list[SimSeq] = field(default_factory=list)
    sampled: int = 0
    encoded: list = field(default_factory=list)  # requests whose images it encoded for another instance (EPD)


@dataclass
class InstanceStats:
    steps: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    role_flips: int = 0
    encoded_images: int = 0


class SimInstance:
    """An engine instance (see the module docstring). ``step_seconds`` maps a step's shape to its
    duration (a ``StepTimeModel``'s ``step_seconds``, possibly scaled)."""

    def __init__(self, instance_id: str, index: int, role: str, kv: SimKV, policy: BatchPolicy,
                 step_seconds: Callable[[StepShape], float], max_num_seqs: int, max_model_len: int = 0,
                 predictor: StepTimeModel | None = None, token_budget: int = 0, encode_image_s: float = 0.0,
                 encode_phase: bool = False) -> None:
        self.instance_id, self.index, self.role = instance_id, index, role
        # an image's encode time; whether the policy runs an encode phase (else images encode in their prefill)
        self.encode_image_s, self.encode_phase = encode_image_s, encode_phase
        # the step-time model and token budget its load reports carry (xllm.core.step_timing.StepTiming.report)
        self.predictor, self.token_budget = predictor, token_budget
        self.kv = kv
        self.policy = policy
        self.step_seconds = step_seconds
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.running: list[SimSeq] = []
        self.waiting: deque[SimSeq] = deque()
        self.reserving: deque[SimSeq] = deque()
        self.awaiting: dict[int, SimSeq] = {}
        self.handing_off: dict[int, SimSeq] = {}
        self.encode_jobs: deque = deque()  # EPD: requests whose images it encodes for another instance
        self._encoding: list = []          # the jobs of the step running
        self.busy = False
        self.step_end = 0.0
        self.step_start = 0.0
        self.chunks: list[ScheduledChunk] = []
        self.stats = InstanceStats()
        self.flipping: str | None = None  # the role it is becoming (draining the old one's work)
        self.step_log: list[tuple] | None = None  # (start, end, instance id, ((rid, tokens), ...)) when a list
        # what the engine measures and reports (EWMAs as xllm.engine.server and xllm.engine_api.stats keep them)
        self.prefill_tps = 0.0
        self.recent_ttft = 0.0
        self.recent_tpot = 0.0
        self._step_prefill = 0
        self._step_decodes = 0

    # ---- queues (xllm.sched.SchedulerQueues) --------------------------------------------------------
    def add(self, seq: SimSeq) -> None:
        """Queue ``seq`` in (priority, arrival) order (a decode-phase one: for a KV reservation)."""
        if seq.phase == DECODE:
            self.reserving.append(seq)
            return
        waiting = self.waiting
        key = (seq.priority, seq.arrival_time)
        idx = len(waiting)
        while idx > 0 and (waiting[idx - 1].priority, waiting[idx - 1].arrival_time) > key:
            idx -= 1
        waiting.insert(idx, seq)

    def allocate(self, seq: SimSeq, num_new_tokens: int) -> bool:
        return self.kv.allocate(seq, num_new_tokens)

    def admit(self, seq: SimSeq, max_new_tokens: int) -> int:
        first = seq.preemptions == 0
        n = self.kv.admit(seq, max_new_tokens, self.max_model_len)
        if n > 0:
            if self.waiting[0] is seq:
                self.waiting.popleft()
            else:
                self.waiting.remove(seq)
            self.running.append(seq)
            if first and seq.phase != DECODE:
                self.stats.prefix_query_tokens += seq.prompt_len
                self.stats.prefix_hit_tokens += min(seq.num_computed_tokens, seq.prompt_len)
        return n

    def preempt(self, seq: SimSeq) -> None:
        self.kv.free(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        seq.num_computed_tokens = 0
        seq.preemptions += 1
        seq.req.preemptions += 1
        self.stats.preemptions += 1

    def remove(self, seq: SimSeq) -> None:
        """Take ``seq`` out of every queue and release its KV (finished, aborted or moved away)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.reserving:
            self.reserving.remove(seq)
        self.awaiting.pop(seq.rid, None)
        self.handing_off.pop(seq.rid, None)
        self.kv.free(seq)

    # ---- PD -----------------------------------------------------------------------------------------
    @property
    def num_holding_kv(self) -> int:
        return len(self.running) + len(self.awaiting) + len(self.handing_off)

    def reserve(self) -> list[SimSeq]:
        """KV for the whole prompt of queued decode-phase sequences (their cached prefix reused), in
        arrival order while ``max_num_seqs`` sequences hold KV at most and memory lasts."""
        out = []
        while self.reserving and self.num_holding_kv < self.max_num_seqs:
            seq = self.reserving[0]
            if self.kv.admit(seq, seq.num_tokens, self.max_model_len) < 1:
                break
            self.reserving.popleft()
            self.awaiting[seq.rid] = seq
            out.append(seq)
        return out

    def install(self, seq: SimSeq) -> None:
        """The prompt's KV arrived for reserved ``seq``: it holds the prompt and token 1 and decodes."""
        del self.awaiting[seq.rid]
        seq.num_computed_tokens = seq.prompt_len
        seq.generated = 1
        seq.num_tokens = seq.prompt_len + 1
        self.kv.on_computed(seq)
        self.running.append(seq)

    def release_handoff(self, seq: SimSeq) -> None:
        """The decode side has the prompt's KV: release it here (its blocks stay cached)."""
        del self.handing_off[seq.rid]
        self.kv.free(seq)

    # ---- load -----------------------------------------------------------------------------------------
    def load_counts(self) -> tuple[int, int, int, int]:
        """Prompt tokens still to compute (queued requests and running ones mid-prefill), the offline
        share of them, and the offline sequences running and waiting — one pass over each queue."""
        total = offline = off_waiting = off_running = 0
        for s in self.waiting:
            n = s.num_tokens - s.num_computed_tokens
            total += n
            if s.offline:
                offline += n
                off_waiting += 1
        for s in self.running:
            n = s.num_tokens - s.num_computed_tokens
            if n > 1:
                total += n
            if s.offline:
                off_running += 1
                offline += n if n > 1 else 0
        return total, offline, off_running, off_waiting

    def add_encode_job(self, req) -> None:
        """Encode ``req``'s images for another instance's prefill (EPD), with its next step."""
        self.encode_jobs.append(req)

    def observe_ttft(self, ttft: float) -> None:
        self.recent_ttft = ttft if self.recent_ttft == 0 else 0.9 * self.recent_ttft + 0.1 * ttft

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- steps ----------------------------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Plan a step at ``now`` with the batch policy; its end time, or None (nothing to run: idle)."""
        plan = self.policy.schedule(self)
        jobs, self.encode_jobs = list(self.encode_jobs), deque()
        if not plan.chunks and not plan.encodes and not jobs:
            self.busy = False
            return None
        self._encoding = jobs
        images = sum(req.spec.images for req in jobs)
        for seq in [*plan.encodes, *(c.seq for c in plan.chunks if not self.encode_phase)]:
            images += seq.encode_pending
            seq.encode_pending = 0
        decodes: list[int] = []
        prefills: list[tuple[int, int]] = []
        for c in plan.chunks:
            seq, n = c.seq, c.num_tokens
            cached = seq.num_computed_tokens
            if n == 1 and cached + 1 == seq.num_tokens and cached > 0:
                decodes.append(cached + 1)
            else:
                prefills.append((cached, n))
        duration = (self.step_seconds(StepShape(tuple(decodes), tuple(prefills))) if plan.chunks else 0.0) \
            + images * self.encode_image_s
        self.chunks = plan.chunks
        self.busy = True
        self.step_start = now
        self.step_end = now + duration
        if self.step_log is not None:
            self.step_log.append((now, self.step_end, self.instance_id,
                                  tuple((c.seq.rid, c.num_tokens) for c in plan.chunks)))
        st = self.stats
        st.steps += 1
        st.busy_s += duration
        st.decode_tokens += len(decodes)
        st.encoded_images += images
        self._step_prefill = sum(n for _, n in prefills)
        self._step_decodes = len(decodes)
        st.prefill_tokens += self._step_prefill
        return self.step_end

    def finish_step(self) -> StepResult:
        """Land the step: advance, cache, sample, retire (see the module docstring)."""
        result = StepResult()
        kv = self.kv
        bs = kv.block_size
        first, done = result.first, result.done
        sampled = 0
        for c in self.chunks:
            seq = c.seq
            computed = seq.num_computed_tokens + c.num_tokens
            seq.num_computed_tokens = computed
            if computed // bs > seq.nhashed:
                kv.on_computed(seq)
            if computed == seq.num_tokens:
                sampled += 1
                seq.generated += 1
                if seq.generated == 1:
                    first.append(seq)
                if seq.generated >= seq.output_len or seq.phase == PREFILL:
                    done.append(seq)
                else:
                    seq.num_tokens = computed + 1
        self.chunks = []
        result.encoded, self._encoding = self._encoding, []
        seconds = self.step_end - self.step_start
        if self._step_prefill and seconds > 0:
            rate = self._step_prefill / seconds
            self.prefill_tps = rate if self.prefill_tps == 0 else 0.8 * self.prefill_tps + 0.2 * rate
        if self._step_decodes:  # every decode row's inter-token latency is about this step's length
            keep = 0.9 ** self._step_decodes
            self.recent_tpot = seconds if self.recent_tpot == 0 else seconds + keep * (self.recent_tpot - seconds)
        for seq in done:
            self.running.remove(seq)
            if seq.phase == PREFILL and seq.generated < seq.output_len:
                self.handing_off[seq.rid] = seq  # KV kept for the transfer to the decode side
            else:
                kv.free(seq)
        result.sampled = sampled
        return result
