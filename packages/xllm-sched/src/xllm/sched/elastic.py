"""Dynamic PD roles (xLLM §3.2): which prefill/decode instance should change role, and why.

Pure logic over one :class:`RoleLoad` per PD instance (no I/O, no torch): the gateway builds the
loads from the instances' load reports and the latencies it measures itself, asks a policy
(:data:`xllm.sched.registry.PD_POLICIES`) every interval, and carries out the flips it returns
(:mod:`xllm.gateway.roles`); the cluster simulator calls the same code.

- ``static`` (:class:`StaticRoles`): roles never change (the operator's ``--role``).
- ``dynamic`` (:class:`SLORoleFlipPolicy`): roles follow the SLO headroom of each side.

**Pressure.** Each side's pressure is its latency estimate over its SLO, averaged over the side's
instances that are not flipping: the prefill side's time to first token (the larger of the TTFT
measured on recent requests and the one predicted from the queued prefill work: a
:class:`~xllm.sched.latency.StepTimeModel` when given, else the queue over the measured prefill
speed) against ``slo_ttft_s``; the decode side's time per output token (measured, or predicted
with a model from the batch each instance was given: running and waiting requests) against
``slo_tpot_s``.

**Flips.**

- TTFT pressure (prefill side ≥ ``high`` × SLO, held for ``window_s``) → the least loaded decode
  instance becomes a prefill instance, if the decode side can spare one: its pressure scaled by
  n/(n−1) (the same load on one instance fewer) stays below ``high``, so the flip cannot itself
  set off the opposite one (the N/(N−1) check Dynamo's planner added against flapping).
- TPOT pressure (decode side, the same way) → the least loaded prefill instance becomes a decode
  instance, under the same check on the prefill side.
- Idle prefill capacity: the prefill side below ``low`` (TTFT headroom) while one of its instances
  has no work at all, held for ``window_s`` → that instance becomes a decode instance (xLLM flips
  idle prefill instances; decode instances hold the long-lived KV). Decode instances never flip
  for idleness, so an idle cluster settles instead of cycling.

**Batches.** With the class defaults a decision flips one instance, so a cluster shifts by at most one instance
per ``max(window_s, cluster_cooldown_s)`` — fine for a few instances, far too slow for hundreds
(200 instances whose load swings between prefill-heavy and decode-heavy need tens of flips per
swing). The gateway therefore sets both limits to :func:`auto_flips` (a tenth of the PD instances)
unless told otherwise. With ``max_flips_per_decision`` k > 1 one decision may flip up to k instances the same way
(the least loaded first, each out of its cool-down, and never more than ``max_in_progress`` under way
in all): as many as bring the pressured side below ``high`` if the load spread evenly (n·(p/high − 1)
more instances for a side of n at p × SLO), as far as the other side, with those instances fewer,
stays below ``high`` and keeps ``min_per_role``. Idle prefill capacity is not urgent and still flips
one instance per decision: batching it handed every idle prefill instance to a decode side that
did not need them during a decode-heavy spell, and the next prefill-heavy spell then met a prefill
side a fifth of its size (found in the simulator at 200 instances).

**Against flapping.** Hysteresis: a pressure switches on at ``high`` and off only below ``low``,
and must be on for ``window_s`` before it flips anything; every flip resets those windows (the
next one needs fresh evidence measured after it). Cool-downs: an instance flips at most once per
``cooldown_s``; the cluster at most once per ``cluster_cooldown_s``, and never while
``max_in_progress`` flips are still under way. At least ``min_per_role`` (≥ 1) instances of each
role stay, counting only instances that are not flipping. An instance already flipping is never
chosen. Ties go to the instance flipped most recently (reversing a flip beats disturbing another
instance, as xLLM prefers its P→D / D→P pools), then to the smaller instance id.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from xllm.sched.latency import StepTimeModel

PREFILL, DECODE = "prefill", "decode"
PD_ROLES = (PREFILL, DECODE)
FLIP_TRIGGERS = ("ttft_pressure", "tpot_pressure", "prefill_idle")
"""Why a flip was decided, as a short name (a metric label); :attr:`RoleFlip.reason` says it in full."""


class WindowMean:
    """Samples of one quantity over the last ``horizon`` seconds; their mean (0 when none). What the
    gateway measures per instance for the role policy (latencies, prompt sizes), and the simulator
    as the gateway does."""

    def __init__(self, horizon: float) -> None:
        self.horizon = horizon
        self._samples: deque[tuple[float, float]] = deque()
        self._sum = 0.0

    def add(self, now: float, value: float) -> None:
        """Record a sample; samples past the horizon expire here too, so a window nobody reads (a
        gateway without PD instances still measures each chunk) stays bounded."""
        self._samples.append((now, value))
        self._sum += value
        self._expire(now)

    def __len__(self) -> int:
        """Samples held (those within the horizon of the latest time seen)."""
        return len(self._samples)

    def _expire(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.horizon:
            self._sum -= self._samples.popleft()[1]

    def mean(self, now: float) -> float:
        self._expire(now)
        if not self._samples:
            self._sum = 0.0
            return 0.0
        return max(self._sum / len(self._samples), 0.0)


@dataclass(frozen=True)
class RoleLoad:
    """One prefill or decode instance as a role policy sees it.

    ``ttft_s`` / ``tpot_s``: latencies measured on its recent requests (0 = none measured lately);
    ``flipping``: a flip of this instance is under way (``role`` is still the role it flips from);
    ``prefill_tokens_per_s``: its measured prefill speed (0 = unknown), to predict its queue's wait
    without a step model; ``decode_context_tokens``: the context its running requests attend to
    (TPOT predicted with a step model); ``step_model``: the instance's own step-time model as it
    reports it (its profile or self-fit, corrected online by its measured steps), used instead of the
    policy's cluster-wide ``predictor`` for this instance; ``recent_prompt_tokens``: the mean prompt
    tokens to compute of the requests recently sent there to prefill (0 = none lately), the size of a
    new request's prefill and of each prompt in its queue."""

    instance_id: str
    role: str
    num_running: int
    num_waiting: int
    pending_prefill_tokens: int
    ttft_s: float
    tpot_s: float
    flipping: bool = False
    prefill_tokens_per_s: float = 0.0
    decode_context_tokens: int = 0
    step_model: StepTimeModel | None = None
    recent_prompt_tokens: float = 0.0

    @property
    def outstanding(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def idle(self) -> bool:
        """Nothing running, waiting or queued for prefill."""
        return self.outstanding == 0 and self.pending_prefill_tokens == 0


@dataclass(frozen=True)
class RoleFlip:
    """``instance_id`` should change from ``from_role`` to ``to_role``; ``reason`` in words,
    ``trigger`` one of :data:`FLIP_TRIGGERS`."""

    instance_id: str
    from_role: str
    to_role: str
    reason: str
    trigger: str = ""


@dataclass(frozen=True)
class RolePressure:
    """Each side's latency estimate (mean over its instances that are not flipping, seconds) and as
    a multiple of its SLO, with how many instances each side has."""

    ttft_s: float
    tpot_s: float
    ttft: float
    tpot: float
    num_prefill: int
    num_decode: int

    def describe(self) -> str:
        return (f"TTFT {_ms(self.ttft_s)} ({self.ttft:.2f}x SLO) over {self.num_prefill} prefill, "
                f"TPOT {_ms(self.tpot_s)} ({self.tpot:.2f}x SLO) over {self.num_decode} decode")


class RolePolicy(ABC):
    """Decides role flips of a cluster's prefill and decode instances (mixed instances are ignored)."""

    name = "abstract"

    @abstractmethod
    def decide(self, now: float, instances: Sequence[RoleLoad]) -> list[RoleFlip]:
        """The flips to start now (``now``: a monotonic clock in seconds). The policy remembers
        what it decided (cool-downs); the caller reports flips under way as ``flipping``."""


class StaticRoles(RolePolicy):
    """Roles stay as the instances registered them. Accepts (and ignores) the arguments of
    :class:`SLORoleFlipPolicy`, so ``PD_POLICIES.create(name, ...)`` builds either."""

    name = "static"

    def __init__(self, *_slos: float | None, **_options: object) -> None:
        pass

    def decide(self, now: float, instances: Sequence[RoleLoad]) -> list[RoleFlip]:
        return []


class _Hysteresis:
    """One pressure signal: on from ``value >= high``, off again only at ``value < low``."""

    def __init__(self) -> None:
        self.since: float | None = None

    def update(self, value: float, high: float, low: float, now: float) -> None:
        if value >= high:
            if self.since is None:
                self.since = now
        elif value < low:
            self.since = None

    def held_for(self, now: float) -> float:
        """How long the signal has been on (-1: off)."""
        return -1.0 if self.since is None else now - self.since


def auto_flips(num_instances: int) -> int:
    """Flips per decision (and under way at once) when not set: a tenth of the ``num_instances`` PD
    instances, at least 1 — one for a small cluster; at 200 instances the simulator measured 20
    per decision meeting the SLO for 90 % of requests where one flip per decision met it for 81 %
    (docs/scheduling.md)."""
    return max(1, num_instances // 10)


class SLORoleFlipPolicy(RolePolicy):
    """Flips roles by SLO headroom with hysteresis and cool-downs (see the module docstring).

    ``slo_ttft_s`` / ``slo_tpot_s``: the targets (seconds, > 0); ``high`` / ``low``: the fractions
    of the SLO at which a pressure switches on / off (0 < low ≤ high); ``window_s``: how long a
    pressure (or idle prefill capacity) must hold before it flips an instance; ``cooldown_s``: per
    instance, ``cluster_cooldown_s``: between any two flips; ``min_per_role``: instances each role
    keeps (≥ 1); ``max_in_progress``: flips under way at once; ``max_flips_per_decision``: instances
    one decision may flip together (≥ 1; see "Batches"); either ``None``: a tenth of the PD
    instances at the decision, at least 1 (:func:`auto_flips`, the gateway's default);
    ``predictor`` (optional): step times to predict TTFT from queued prefill work (chunked by
    ``token_budget`` tokens per step; 0: one chunk) and TPOT from the running batch."""

    name = "dynamic"

    def __init__(self, slo_ttft_s: float, slo_tpot_s: float, *, high: float = 0.9, low: float = 0.6,
                 window_s: float = 5.0, cooldown_s: float = 30.0, cluster_cooldown_s: float = 10.0,
                 min_per_role: int = 1, max_in_progress: int | None = 1, predictor: StepTimeModel | None = None,
                 token_budget: int = 0, max_flips_per_decision: int | None = 1) -> None:
        for name, value in (("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s)):
            if value is None or not math.isfinite(value) or value <= 0:
                raise ValueError(f"dynamic PD roles need a positive {name}, got {value!r}")
        if not 0 < low <= high:
            raise ValueError(f"pressure thresholds need 0 < low <= high, got low={low}, high={high}")
        for name, value in (("window_s", window_s), ("cooldown_s", cooldown_s),
                            ("cluster_cooldown_s", cluster_cooldown_s)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
        if min_per_role < 1:
            raise ValueError(f"min_per_role must be at least 1 (each role keeps an instance), got {min_per_role}")
        if max_in_progress is not None and max_in_progress < 1:
            raise ValueError(f"max_in_progress must be at least 1, got {max_in_progress}")
        if max_flips_per_decision is not None and max_flips_per_decision < 1:
            raise ValueError(f"max_flips_per_decision must be at least 1, got {max_flips_per_decision}")
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.high, self.low = high, low
        self.window_s, self.cooldown_s, self.cluster_cooldown_s = window_s, cooldown_s, cluster_cooldown_s
        self.min_per_role, self.max_in_progress = min_per_role, max_in_progress
        self.max_flips_per_decision = max_flips_per_decision
        self.predictor, self.token_budget = predictor, token_budget
        self._ttft = _Hysteresis()
        self._tpot = _Hysteresis()
        self._idle_since: float | None = None
        self._last_flip: dict[str, float] = {}
        self._last_cluster_flip = -math.inf
        self.last_pressure: RolePressure | None = None  # of the last decide() (status pages, logs)

    # ---- estimates ------------------------------------------------------------------------------
    def ttft_estimate(self, load: RoleLoad) -> float:
        """Seconds to a new request's first token on a prefill instance: the larger of the measured
        TTFT and the predicted one — the wait behind its queued prefill work (taken as prompts of the
        recent mean size) plus a recent-mean prompt's own prefill. The measured TTFT lags (it is known
        only at first tokens, averaged over seconds); the prediction moves with the queue at once. A
        prompt's own prefill is a large part of the objective (a 2,048-token one took 56 % of it in the
        200-instance simulation): leaving it out, the prefill side's pressure stayed near 0.7x while 10–
        20 % of its requests missed, so it never flipped an instance to follow a prefill-heavy spell."""
        predicted = 0.0
        pending, prompt = load.pending_prefill_tokens, max(load.recent_prompt_tokens, 0.0)
        model = load.step_model or self.predictor
        if pending > 0 or prompt >= 1:
            if model is not None:
                predicted = model.queue_seconds(pending, prompt, self.token_budget)
                if prompt >= 1:
                    predicted += model.prefill_seconds(int(prompt), token_budget=self.token_budget)
            elif load.prefill_tokens_per_s > 0:
                predicted = (pending + prompt) / load.prefill_tokens_per_s
        return max(load.ttft_s, predicted)

    def tpot_estimate(self, load: RoleLoad) -> float:
        """Seconds per output token on a decode instance: measured, or predicted from the batch it
        was given — its running requests and those waiting there (for a KV reservation or a batch
        slot), at the running ones' mean context: a decode instance too full to admit its queue is
        short of decode capacity even while the batch it runs keeps its TPOT."""
        predicted = 0.0
        n = load.num_running + load.num_waiting
        model = load.step_model or self.predictor
        if model is not None and n > 0:
            per_seq = load.decode_context_tokens / load.num_running if load.num_running else 0.0
            predicted = model.decode_seconds(n, int(per_seq * n))
        return max(load.tpot_s, predicted)

    def pressure(self, instances: Sequence[RoleLoad]) -> RolePressure:
        """Both sides' pressure over the instances that are not flipping."""
        prefills = [x for x in instances if x.role == PREFILL and not x.flipping]
        decodes = [x for x in instances if x.role == DECODE and not x.flipping]
        ttft = _mean([self.ttft_estimate(x) for x in prefills])
        tpot = _mean([self.tpot_estimate(x) for x in decodes])
        return RolePressure(ttft, tpot, ttft / self.slo_ttft_s, tpot / self.slo_tpot_s, len(prefills), len(decodes))

    # ---- deciding -------------------------------------------------------------------------------
    def decide(self, now: float, instances: Sequence[RoleLoad]) -> list[RoleFlip]:
        loads = [x for x in instances if x.role in PD_ROLES]
        prefills = [x for x in loads if x.role == PREFILL and not x.flipping]
        decodes = [x for x in loads if x.role == DECODE and not x.flipping]
        p = self.last_pressure = self.pressure(loads)
        self._ttft.update(p.ttft, self.high, self.low, now)
        self._tpot.update(p.tpot, self.high, self.low, now)
        idle_now = p.ttft < self.low and any(x.idle for x in prefills)
        if not idle_now:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        if not prefills or not decodes:
            return []
        auto = auto_flips(len(loads))
        room = (self.max_in_progress or auto) - sum(x.flipping for x in loads)
        if room < 1 or now - self._last_cluster_flip < self.cluster_cooldown_s:
            return []
        room = min(room, self.max_flips_per_decision or auto)
        flips = self._toward_prefill(now, p, decodes, room) or self._toward_decode(now, p, prefills, room)
        if not flips:
            return []
        for flip in flips:
            self._last_flip[flip.instance_id] = now
        self._last_cluster_flip = now
        self._ttft, self._tpot, self._idle_since = _Hysteresis(), _Hysteresis(), None  # fresh evidence next
        return flips

    def _spare(self, pressure: float, n: int, limit: int) -> int:
        """How many of a side's ``n`` instances at ``pressure`` can go (≤ ``limit``): it keeps
        ``min_per_role`` and stays below ``high`` with the same load on the rest (0: none)."""
        k = min(limit, n - self.min_per_role)
        while k > 0 and pressure * n / (n - k) >= self.high:
            k -= 1
        return k

    def _need(self, pressure: float, n: int) -> int:
        """Instances a side of ``n`` at ``pressure`` needs more to fall below ``high`` (at least 1)."""
        return max(1, math.ceil(n * (pressure / self.high - 1)))

    def _toward_prefill(self, now: float, p: RolePressure, decodes: list[RoleLoad], room: int) -> list[RoleFlip]:
        held = self._ttft.held_for(now)
        if held < self.window_s:
            return []
        k = self._spare(p.tpot, len(decodes), min(room, self._need(p.ttft, p.num_prefill)))
        if k < 1:
            return []  # both sides short: a flip would only move the problem
        picks = self._pick(now, decodes, lambda x: (x.outstanding, x.decode_context_tokens), k)
        n = len(decodes)
        out = []
        for pick in picks:
            fewer = "one fewer" if len(picks) == 1 else f"{len(picks)} fewer"
            after = p.tpot * n / (n - len(picks))
            reason = (f"TTFT pressure: prefill side at {p.ttft:.2f}x its {_ms(self.slo_ttft_s)} SLO "
                      f"(TTFT {_ms(p.ttft_s)} over {p.num_prefill} instance(s), >= {self.high:.2f}x for "
                      f"{held:.1f} s); the decode side can spare {pick.instance_id} ({pick.outstanding} request(s)): "
                      f"TPOT {p.tpot:.2f}x its {_ms(self.slo_tpot_s)} SLO now, {after:.2f}x with {fewer}")
            out.append(RoleFlip(pick.instance_id, DECODE, PREFILL, reason, "ttft_pressure"))
        return out

    def _toward_decode(self, now: float, p: RolePressure, prefills: list[RoleLoad], room: int) -> list[RoleFlip]:
        n = len(prefills)
        if self._spare(p.ttft, n, 1) < 1:
            return []
        held = self._tpot.held_for(now)
        if held >= self.window_s:
            trigger, candidates = "tpot_pressure", prefills
            k = self._spare(p.ttft, n, min(room, self._need(p.tpot, p.num_decode)))
            picks = self._pick(now, candidates, lambda x: (x.pending_prefill_tokens, x.outstanding), k)
        elif self._idle_since is not None and now - self._idle_since >= self.window_s:
            trigger, candidates = "prefill_idle", [x for x in prefills if x.idle]
            picks = self._pick(now, candidates, lambda x: (), self._spare(p.ttft, n, 1))  # idleness is not urgent
        else:
            return []
        out = []
        for pick in picks:
            fewer = "one fewer" if len(picks) == 1 else f"{len(picks)} fewer"
            side = (f"the prefill side can spare it: TTFT {p.ttft:.2f}x its {_ms(self.slo_ttft_s)} SLO now, "
                    f"{p.ttft * n / (n - len(picks)):.2f}x with {fewer}")
            if trigger == "tpot_pressure":
                reason = (f"TPOT pressure: decode side at {p.tpot:.2f}x its {_ms(self.slo_tpot_s)} SLO "
                          f"(TPOT {_ms(p.tpot_s)} over {p.num_decode} instance(s), >= {self.high:.2f}x for "
                          f"{held:.1f} s); {pick.instance_id} is the least loaded prefill instance and {side}")
            else:
                reason = (f"idle prefill capacity: {pick.instance_id} has no work and the prefill side is at "
                          f"{p.ttft:.2f}x its TTFT SLO (< {self.low:.2f}x for {now - self._idle_since:.1f} s); {side}")
            out.append(RoleFlip(pick.instance_id, PREFILL, DECODE, reason, trigger))
        return out

    def _pick(self, now: float, candidates: list[RoleLoad], load, k: int = 1) -> list[RoleLoad]:
        """The ``k`` least loaded candidates out of their cool-down; ties: the most recently flipped,
        then by id."""
        ready = [x for x in candidates if now - self._last_flip.get(x.instance_id, -math.inf) >= self.cooldown_s]
        ready.sort(key=lambda x: (load(x), -self._last_flip.get(x.instance_id, -math.inf), x.instance_id))
        return ready[:max(k, 0)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
