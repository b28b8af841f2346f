"""Dynamic PD roles, the gateway's side (xLLM §3.2): flipping prefill and decode instances at run time.

An engine holds no role-specific state: its ``--role`` is only a label in its registration, and
every engine serves both phases. So a flip is the gateway's decision alone, carried out in its
routing — no restart, no reload. :class:`RoleController` keeps the current role of each PD
instance (:attr:`InstanceState.assigned_role <xllm.gateway.registry.base.InstanceState>`, initially
the registered one) and every ``interval`` seconds

1. advances the flips under way: one completes when the instance holds nothing of its old role
   any more (the gateway's own requests there, ``InstanceState.inflight``), or at
   ``flip_timeout_s`` whatever it still holds (it serves both phases anyway);
2. builds one :class:`~xllm.sched.elastic.RoleLoad` per PD instance from its load report, this
   gateway's queued prefill work there and the latencies this gateway measured itself
   (:class:`LatencyTracker`: TTFT of the requests each prefill instance served, TPOT of the
   chunks each decode instance streamed, over the last ``latency_window_s``);
3. asks the role policy (``--pd-policy``: :data:`xllm.sched.PD_POLICIES`) and starts its flips.

A flip **decode → prefill**: the instance leaves both pools at once (no new decode placements, no
prefills yet); each request decoding there is handed over as a draining instance's requests are —
on the request's next chunk its :class:`~xllm.gateway.dispatch.RoutedStream` sees the flip
(:func:`hands_over`) and the :class:`~xllm.gateway.moves.Mover` makes the move offer itself and
migrates it with its KV or recomputes it elsewhere, whichever it predicts quicker; a request whose
prefill is still running elsewhere is handed over once it decodes there. When it holds none, it
joins the prefill pool. A flip **prefill → decode**: no new prefills; the ones in flight finish
(they are short); then it takes decode placements. Every flip is logged when it starts and when it
ends (instance, roles, trigger, reason, duration), counted in ``xllm:pd_role_flips_total`` and shown
by ``/health``.

The roles live in this gateway only: the registry (etcd included) keeps the role each instance
registered with, which an instance that restarts or re-registers takes again. Several gateways
on one etcd prefix each flip on their own view of the load (correct, as every engine serves both
phases, but not coordinated).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from xllm.gateway.events import EventSink, publish_safely
from xllm.gateway.metrics import PDRoleMetrics
from xllm.gateway.registry.base import InstanceState, Registry, RoleTransition
from xllm.sched import PD_POLICIES, RoleFlip, RoleLoad, RolePolicy
from xllm.sched.elastic import PD_ROLES, WindowMean
from xllm.sched.latency import StepTimeModel

if TYPE_CHECKING:
    from xllm.gateway.router import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PDRoleOptions:
    """How the gateway flips PD roles: ``policy`` (a :data:`~xllm.sched.PD_POLICIES` name), the SLOs
    ``dynamic`` needs, its hysteresis window and cool-downs (see :class:`~xllm.sched.SLORoleFlipPolicy`),
    ``max_flips`` per decision and under way at once (``None``: :func:`xllm.sched.elastic.auto_flips`,
    a tenth of the PD instances), ``interval`` between decisions, ``latency_window_s`` of measured
    latencies, ``flip_timeout_s``
    after which a flip completes whatever the instance still holds, an optional step-time
    ``predictor`` (TTFT predicted from queued prefill work), and ``prefill_overflow``: with
    ``slo_ttft_s``, placement runs a request whole on a decode instance when every prefill instance
    is predicted to miss it (:class:`xllm.sched.PDPlacement`; either policy)."""

    policy: str = "static"
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    window_s: float = 5.0
    cooldown_s: float = 30.0
    cluster_cooldown_s: float = 10.0
    min_per_role: int = 1
    max_flips: int | None = None
    interval: float = 0.5
    latency_window_s: float = 10.0
    flip_timeout_s: float = 120.0
    predictor: StepTimeModel | None = None
    prefill_overflow: bool = True

    def __post_init__(self) -> None:
        name = PD_POLICIES.canonical(self.policy)
        if name == "dynamic" and (self.slo_ttft_s is None or self.slo_tpot_s is None):
            raise ValueError("--pd-policy dynamic flips roles by SLO headroom: give --slo-ttft-ms and --slo-tpot-ms")
        for what, value in (("interval", self.interval), ("latency_window_s", self.latency_window_s),
                            ("flip_timeout_s", self.flip_timeout_s)):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"PD role {what} must be a positive number of seconds, got {value!r}")
        self.build_policy()  # its own checks (thresholds, cool-downs, min per role), now rather than later

    @property
    def overflow_slo_ttft_s(self) -> float | None:
        """The TTFT objective PD placement overflows prefills against (``None``: no overflow)."""
        return self.slo_ttft_s if self.prefill_overflow else None

    def build_policy(self) -> RolePolicy:
        return PD_POLICIES.create(self.policy, self.slo_ttft_s, self.slo_tpot_s, window_s=self.window_s,
                                  cooldown_s=self.cooldown_s, cluster_cooldown_s=self.cluster_cooldown_s,
                                  min_per_role=self.min_per_role, max_in_progress=self.max_flips,
                                  max_flips_per_decision=self.max_flips, predictor=self.predictor)


class LatencyTracker:
    """What this gateway measured per instance: time to first token of the requests each one
    prefilled, time per output token of the chunks each one streamed, and the prompt tokens to compute
    of the requests it sent each one to prefill (recent windows)."""

    def __init__(self, horizon: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.horizon = horizon
        self.clock = clock
        self._ttft: dict[str, WindowMean] = {}
        self._tpot: dict[str, WindowMean] = {}
        self._prompt: dict[str, WindowMean] = {}

    def ttft(self, instance_id: str, seconds: float) -> None:
        self._window(self._ttft, instance_id).add(self.clock(), seconds)

    def tpot(self, instance_id: str, seconds: float) -> None:
        self._window(self._tpot, instance_id).add(self.clock(), seconds)

    def prompt(self, instance_id: str, tokens: int) -> None:
        """A request with ``tokens`` prompt tokens to compute was sent to ``instance_id`` to prefill."""
        self._window(self._prompt, instance_id).add(self.clock(), tokens)

    def recent(self, instance_id: str) -> tuple[float, float]:
        """(mean TTFT, mean TPOT) over the window, 0 where nothing was measured."""
        now = self.clock()
        ttft, tpot = self._ttft.get(instance_id), self._tpot.get(instance_id)
        return (ttft.mean(now) if ttft else 0.0), (tpot.mean(now) if tpot else 0.0)

    def recent_prompt(self, instance_id: str) -> float:
        """Mean prompt tokens to compute of the requests sent there to prefill over the window (0: none)."""
        window = self._prompt.get(instance_id)
        return window.mean(self.clock()) if window else 0.0

    def forget(self, instance_id: str) -> None:
        self._ttft.pop(instance_id, None)
        self._tpot.pop(instance_id, None)
        self._prompt.pop(instance_id, None)

    def _window(self, table: dict[str, WindowMean], instance_id: str) -> WindowMean:
        window = table.get(instance_id)
        if window is None:
            window = table[instance_id] = WindowMean(self.horizon)
        return window


@dataclass
class FlipRecord:
    """One role flip as the live cluster page shows it (:attr:`RoleController.history`): wall-clock
    ``started`` / ``ended`` (unix seconds; ``ended`` None while under way), ``outcome`` ``""`` while under
    way, then ``done``, ``timed_out`` (completed still holding requests) or ``abandoned`` (the instance left)."""

    instance: str
    model: str
    from_role: str
    to_role: str
    trigger: str
    reason: str
    started: float
    ended: float | None = None
    outcome: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


FLIP_HISTORY = 200  # flips RoleController.history keeps (the newest)


def pool_name(state: InstanceState) -> str:
    """The pool an instance is in: its role, or ``<from>_to_<to>`` while it flips (xLLM's four pools)."""
    return state.role if state.flip is None else f"{state.flip.from_role}_to_{state.flip.to_role}"


POOLS = ("prefill", "decode", "decode_to_prefill", "prefill_to_decode")


def hands_over(state: InstanceState) -> bool:
    """Whether the requests decoding on ``state`` must leave it: its role flips from decode to
    prefill. Each is offered to move as a draining instance's are (:meth:`Mover.handover
    <xllm.gateway.moves.Mover.handover>`), once it decodes there."""
    return state.flip is not None and state.flip.to_role == "prefill"


class RoleController:
    """Runs the role policy over the registry's PD instances and carries out its flips (module
    docstring). ``on_role(state)``: called when an instance's role changed (its metrics label).
    ``history``: the last :data:`FLIP_HISTORY` flips (:class:`FlipRecord`, oldest first); ``publish(kind,
    data)``, when set: told ``role_flip_started`` / ``role_flip_finished`` with a record's dict (the live
    cluster page's event feed, :mod:`xllm.gateway.dashboard`); it must not raise nor block."""

    def __init__(self, registry: Registry, router: Router, options: PDRoleOptions | None = None,
                 metrics: PDRoleMetrics | None = None, on_role: Callable[[InstanceState], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, events: EventSink | None = None) -> None:
        self.registry = registry
        self.router = router
        self.options = options or PDRoleOptions()
        self.metrics = metrics or PDRoleMetrics()
        self.on_role = on_role
        self.clock = clock
        self.policies: dict[str, RolePolicy] = {}  # per model: a policy keeps its cluster's history
        self._task: asyncio.Task | None = None
        router.latency.horizon = self.options.latency_window_s
        self.history: deque[FlipRecord] = deque(maxlen=FLIP_HISTORY)
        self._open: dict[str, FlipRecord] = {}  # instance id -> its flip under way
        self.events = events  # role_flip_started / role_flip_finished (the cluster page)

    # ---- running ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # a bug here must not stop the flips (nor the routing: it never touches it)
                log.exception("PD role controller tick failed")
            await asyncio.sleep(self.options.interval)

    def tick(self) -> list[RoleFlip]:
        """One round: advance the flips under way, decide, start the new flips (returned)."""
        now = self.clock()
        started: list[RoleFlip] = []
        for model in self.registry.served_models():
            for state in self.registry.states(model):
                if state.flip is not None:
                    self._advance(state, now)
            loads = self.loads(model)
            if loads:
                policy = self.policies.get(model)
                if policy is None:
                    policy = self.policies[model] = self.options.build_policy()
                started += [f for f in policy.decide(now, loads) if self.begin(f, now)]
            self._count_pools(model)
        return started

    # ---- what the policy sees ----------------------------------------------------------------------
    def loads(self, model: str) -> list[RoleLoad]:
        """One load per PD instance of ``model`` that may get work (or is flipping)."""
        routable = {s.instance_id for s in self.registry.routable(model)}
        out = []
        for s in self.registry.states(model):
            if s.role not in PD_ROLES or (s.instance_id not in routable and s.flip is None):
                continue
            snap = self.router.snapshot(s, 0)
            ttft, tpot = self.router.latency.recent(s.instance_id)
            out.append(RoleLoad(s.instance_id, s.role, snap.num_running,
                                max(snap.num_waiting, s.inflight - snap.num_running, 0),
                                snap.pending_prefill_tokens, ttft, tpot, flipping=s.flip is not None,
                                prefill_tokens_per_s=snap.prefill_tokens_per_s,
                                decode_context_tokens=snap.decode_context_tokens, step_model=snap.step_model,
                                recent_prompt_tokens=self.router.latency.recent_prompt(s.instance_id)))
        return out

    # ---- carrying flips out ------------------------------------------------------------------------
    def begin(self, flip: RoleFlip, now: float | None = None) -> bool:
        """Start ``flip`` (from the policy, or an operator's): the instance leaves both pools and
        its running requests of the old role are handed over. False if it cannot start (gone,
        another role, already flipping)."""
        now = self.clock() if now is None else now
        state = self.registry.get(flip.instance_id)
        if state is None or state.removed or state.role != flip.from_role or state.flip is not None \
                or flip.to_role not in PD_ROLES or flip.to_role == flip.from_role:
            log.warning("PD role flip of %s (%s -> %s) not started: the instance is %s", flip.instance_id,
                        flip.from_role, flip.to_role, "gone" if state is None or state.removed else
                        f"{state.role}{' and flipping' if state.flip else ''}")
            return False
        state.flip = RoleTransition(flip.from_role, flip.to_role, flip.reason, flip.trigger or "manual", now)
        log.info("PD role flip started: instance=%s from=%s to=%s trigger=%s holding=%d reason=%s",
                 flip.instance_id, flip.from_role, flip.to_role, state.flip.trigger, state.inflight, flip.reason,
                 extra={"pd_role_flip": {"instance": flip.instance_id, "from": flip.from_role, "to": flip.to_role,
                                         "trigger": state.flip.trigger, "reason": flip.reason, "event": "started",
                                         "holding": state.inflight}})
        self._record_start(state, flip)
        self._advance(state, now)
        self._count_pools(state.model)
        return True

    def _advance(self, state: InstanceState, now: float) -> None:
        flip = state.flip
        if flip is None:
            return
        if state.removed:
            state.flip = None
            log.warning("PD role flip of %s (%s -> %s) abandoned: the instance left", state.instance_id,
                        flip.from_role, flip.to_role)
            self._record_end(state.instance_id, "abandoned")
            return
        timed_out = now - flip.started >= self.options.flip_timeout_s
        if state.inflight > 0 and not timed_out:
            return
        state.assigned_role, state.flip = flip.to_role, None
        duration = now - flip.started
        log.log(logging.WARNING if state.inflight else logging.INFO,
                "PD role flip done: instance=%s from=%s to=%s trigger=%s duration=%.3fs%s reason=%s",
                state.instance_id, flip.from_role, flip.to_role, flip.trigger, duration,
                f" (timed out still holding {state.inflight} request(s))" if state.inflight else "", flip.reason,
                extra={"pd_role_flip": {"instance": state.instance_id, "from": flip.from_role, "to": flip.to_role,
                                        "trigger": flip.trigger, "reason": flip.reason, "event": "done",
                                        "duration_s": duration, "still_holding": state.inflight}})
        self.metrics.flipped(state.model, flip.from_role, flip.to_role, flip.trigger, duration)
        self._record_end(state.instance_id, "timed_out" if state.inflight else "done")
        if self.on_role is not None:
            self.on_role(state)

    # ---- the flips' history (the live cluster page) ---------------------------------------------------
    def _record_start(self, state: InstanceState, flip: RoleFlip) -> None:
        record = FlipRecord(state.instance_id, state.model, flip.from_role, flip.to_role,
                            flip.trigger or "manual", flip.reason, time.time())
        self.history.append(record)
        self._open[state.instance_id] = record
        self._publish("role_flip_started", record)

    def _record_end(self, instance_id: str, outcome: str) -> None:
        record = self._open.pop(instance_id, None)
        if record is not None:
            record.ended, record.outcome = time.time(), outcome
            self._publish("role_flip_finished", record)

    def _publish(self, kind: str, record: FlipRecord) -> None:
        publish_safely(self.events, kind, record.to_dict())

    def _count_pools(self, model: str) -> None:
        counts = dict.fromkeys(POOLS, 0)
        for s in self.registry.states(model):
            pool = pool_name(s)
            if pool in counts:
                counts[pool] += 1
        self.metrics.set_pools(model, counts)

    def status(self, state: InstanceState) -> dict:
        """What ``/health`` shows of a PD or encode instance's role (nothing for a mixed one)."""
        if state.role not in PD_ROLES:
            return {"role": state.role} if state.role == "encode" else {}
        out: dict = {"role": state.role}
        if state.registered_role != state.role:
            out["registered_role"] = state.registered_role
        if state.flip is not None:
            out["flip"] = {"to": state.flip.to_role, "trigger": state.flip.trigger, "reason": state.flip.reason,
                           "seconds": round(self.clock() - state.flip.started, 3), "holding": state.inflight}
        return out
