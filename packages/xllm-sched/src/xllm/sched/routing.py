"""Global routing policies: which engine instance serves a request.

Pure logic over snapshots of the candidate instances (no I/O, no torch), so the same code
runs in the gateway, in tests and in a simulator. The gateway builds one
:class:`InstanceSnapshot` per live instance of the requested model — load from its last
heartbeat, the requests it dispatched itself and not yet saw finish, and how many of the
prompt's tokens the global KV index says the instance already holds — and asks a policy.

Policies (by name through :data:`xllm.sched.ROUTING_POLICIES`):

- ``round_robin``: the next instance in turn.
- ``least_load``: the fewest outstanding requests (running + waiting), then the lowest KV use.
- ``kv_aware``: RTP-LLM §5.2.5 / xLLM §3.4: for each instance ``w``

      score(w) = α · match_len(w) / len  −  γ · predicted_latency(w) / max_latency

  where ``predicted_latency`` is the time to the request's first token on ``w`` (xLLM §3.1: every
  placement against a latency prediction): the prefill work queued there, then this request's
  uncached tokens, in chunks of ``w``'s token budget that share each step with its decode rows, timed
  by the step-time model ``w`` reports (its profile or self-fit, corrected by its measured steps;
  an instance without one yet borrows the mean of the candidates' models, the instances of one model
  being alike). Without any model it falls back to ``w``'s measured prefill speed (tokens/s of its
  recent prefill steps, with ``decode_weight`` prompt tokens of work per running request). That speed
  depends on the chunk sizes the instance happened to get (a 32-token chunk runs at a fraction of a
  512-token one's tokens/s): an instance warmed up on short prompts looked slow for good and, with
  nothing sent there to measure it again, got nothing while the other queued every request. Blocks
  ``w`` can load from its lower KV tiers (host DRAM, disk, the cluster store) beyond its in-memory
  match count as the load time at
  the tier's measured speed instead of their recompute time, and in ``match_len`` only for the
  share of the recompute time loading saves: a deep hit in a tier slower than recomputing is
  worth nothing, and a shallow hit in memory beats it (RTP-LLM's cache-aware balancing). A tier
  whose speed the instance has not measured yet is treated as recompute. ``kv_aware_t0`` is the same
  policy blind to the lower tiers (only prefixes in engine memory count): the ablation that
  ``python -m benchmarks kv_tiers`` measures tier-aware routing against. A chat/session id is a strong hint: its
  previous instance is taken unless overloaded. A load-aware fallback sends the request to the
  fastest instance instead when the best-scoring one would be much slower, so a hot prefix
  cannot pile every request onto one instance. A LoRA adapter's request pays, on an instance where
  the adapter is not resident in a slot, the adapter's measured load time in its predicted latency, and
  an instance whose slots are all held by other adapters' live requests counts as overloaded: residency
  is weighed against load rather than pinned to (adapter affinity alone hot-spots one instance).
"""

from __future__ import annotations

import itertools
import math
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from xllm.sched.latency import StepTimeModel, mean_model


@dataclass(frozen=True)
class InstanceSnapshot:
    """What a policy knows about one candidate instance at decision time."""

    instance_id: str
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0                # fraction of KV memory in use, 0..1
    pending_prefill_tokens: int = 0      # prompt tokens queued ahead of a new request
    prefill_tokens_per_s: float = 0.0    # measured prefill speed; 0 = unknown
    recent_ttft: float = 0.0             # seconds, moving average
    recent_tpot: float = 0.0
    inflight: int = 0                    # requests this router sent there and not yet saw finish
    matched_tokens: int = 0              # leading prompt tokens already cached there
    cached_blocks: int = 0               # prefix blocks the instance holds (global KV index)
    kv_free_tokens: int = -1             # KV room left, in tokens; -1 = not reported yet
    # the offline (co-location: service_tier flex) share of num_running, num_waiting, inflight and
    # pending_prefill_tokens; 0 where not reported
    offline_running: int = 0
    offline_waiting: int = 0
    offline_inflight: int = 0
    offline_pending_prefill_tokens: int = 0
    # after matched_tokens, prompt tokens it can load from its lower KV tiers: (tier, tokens) runs in
    # prompt order, and each tier's measured load speed (a tier absent: not measured yet). Last, so the
    # simulator's positional construction stays valid.
    lower_matched: tuple[tuple[str, int], ...] = ()
    tier_load_tokens_per_s: tuple[tuple[str, float], ...] = ()
    # the instance's step-time model as it reports it (corrected online; None: it has none yet), the
    # token budget its prefills are chunked by (0: unknown, one chunk) and the context its running
    # requests attend to (the decode rows every prefill chunk shares a step with)
    step_model: StepTimeModel | None = None
    token_budget: int = 0
    decode_context_tokens: int = 0
    # a request of a LoRA adapter (the base model's: the defaults): whether the adapter is resident in one of the
    # instance's slots, the seconds the instance measured reading one into a slot (paid first when it is not),
    # and whether a slot could take it now (none: every slot holds an adapter live requests use; it would park)
    adapter_resident: bool = True
    adapter_load_seconds: float = 0.0
    adapter_slot_free: bool = True

    @property
    def outstanding(self) -> int:
        """Requests on the instance: the larger of its report and what this router sent."""
        return max(self.num_running + self.num_waiting, self.inflight)

    def online_only(self) -> InstanceSnapshot:
        """The instance as an online request sees it: offline work yields to online work (it runs in
        what online work leaves and is preempted for it; ``xllm.sched.colocation``), so it neither
        queues ahead of an online request nor counts as its load."""
        if not (self.offline_running or self.offline_waiting or self.offline_inflight
                or self.offline_pending_prefill_tokens):
            return self
        return replace(
            self, num_running=max(self.num_running - self.offline_running, 0),
            num_waiting=max(self.num_waiting - self.offline_waiting, 0),
            inflight=max(self.inflight - self.offline_inflight, 0),
            pending_prefill_tokens=max(self.pending_prefill_tokens - self.offline_pending_prefill_tokens, 0),
            offline_running=0, offline_waiting=0, offline_inflight=0, offline_pending_prefill_tokens=0)


@dataclass(frozen=True)
class RouteRequest:
    num_prompt_tokens: int
    session_id: str | None = None
    max_new_tokens: int = 0  # how many tokens it may generate (the KV it may need beyond the prompt)
    offline: bool = False    # co-location's best-effort work: it sees all load, online requests online load


def load_as_seen_by(request: RouteRequest, candidates: Sequence[InstanceSnapshot]) -> list[InstanceSnapshot]:
    """The candidates with the load ``request`` waits behind: everything for an offline request, only
    online work for an online one (:meth:`InstanceSnapshot.online_only`). Counting an instance's
    offline backlog against online requests sent them to the instances with the least offline work,
    where they queued behind each other: in a simulation of 20 instances with as much offline work as
    online, routing online requests on online load took online SLO attainment from 61 % to 94 %."""
    if request.offline:
        return list(candidates)
    return [c.online_only() for c in candidates]


@dataclass(frozen=True)
class RouteDecision:
    instance_id: str
    reason: str                           # round_robin | least_load | kv_cache | session | load_fallback | only
    predicted_latency: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)


class RoutingPolicy(ABC):
    """Chooses one of ``candidates`` (never empty) for ``request``."""

    name = "abstract"

    @abstractmethod
    def route(self, request: RouteRequest, candidates: Sequence[InstanceSnapshot]) -> RouteDecision: ...

    def forget_instance(self, instance_id: str) -> None:  # noqa: B027 (optional hook)
        """The instance left the cluster (drop any state about it)."""


def _check(candidates: Sequence[InstanceSnapshot]) -> None:
    if not candidates:
        raise ValueError("no candidate instances")


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def route(self, request: RouteRequest, candidates: Sequence[InstanceSnapshot]) -> RouteDecision:
        _check(candidates)
        ordered = sorted(candidates, key=lambda c: c.instance_id)
        return RouteDecision(ordered[next(self._counter) % len(ordered)].instance_id, "round_robin")


class LeastLoadPolicy(RoutingPolicy):
    """Fewest outstanding requests, then lowest KV usage; ties rotate."""

    name = "least_load"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def route(self, request: RouteRequest, candidates: Sequence[InstanceSnapshot]) -> RouteDecision:
        _check(candidates)
        ordered = sorted(load_as_seen_by(request, candidates), key=lambda c: c.instance_id)
        best = min((c.outstanding, round(c.kv_usage, 2)) for c in ordered)
        ties = [c for c in ordered if (c.outstanding, round(c.kv_usage, 2)) == best]
        return RouteDecision(ties[next(self._counter) % len(ties)].instance_id, "least_load")


class KVCacheAwarePolicy(RoutingPolicy):
    """Prefix-cache reuse traded against predicted latency, with session affinity.

    Parameters:

    - ``alpha``, ``gamma``: weights of the cache-reuse and latency terms of the score.
    - ``default_prefill_rate``: prefill tokens/s assumed for an instance that has not measured
      its own yet (the mean of the measured candidates is used first).
    - ``decode_weight``: prefill-token equivalents of work each running sequence adds before a
      new request's first token (its decode tokens share every step).
    - ``fallback_ratio``, ``fallback_slack``: the chosen instance must not be predicted slower
      than ``fallback_ratio`` × the fastest candidate's latency + ``fallback_slack`` seconds,
      otherwise the fastest candidate is taken (reason ``load_fallback``).
    - ``max_waiting``, ``kv_high_watermark``: an instance with this many waiting requests or
      this KV usage is overloaded; it is avoided while others are not.
    - ``session_ttl``, ``max_sessions``: how long and how many chat sessions are remembered.
    """

    name = "kv_aware"

    def __init__(self, alpha: float = 1.0, gamma: float = 1.0, default_prefill_rate: float = 1000.0,
                 decode_weight: float = 8.0, fallback_ratio: float = 2.0, fallback_slack: float = 0.25,
                 max_waiting: int = 64, kv_high_watermark: float = 0.95, session_ttl: float = 600.0,
                 max_sessions: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        if alpha < 0 or gamma < 0 or default_prefill_rate <= 0 or fallback_ratio < 1:
            raise ValueError("alpha, gamma >= 0, default_prefill_rate > 0 and fallback_ratio >= 1 are required")
        self.alpha, self.gamma = alpha, gamma
        self.default_prefill_rate = default_prefill_rate
        self.decode_weight = decode_weight
        self.fallback_ratio, self.fallback_slack = fallback_ratio, fallback_slack
        self.max_waiting, self.kv_high_watermark = max_waiting, kv_high_watermark
        self.session_ttl, self.max_sessions = session_ttl, max_sessions
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._clock = clock
        self._turn = itertools.count()

    # ---- the performance model ------------------------------------------------------------
    def _rate(self, c: InstanceSnapshot, fallback: float) -> float:
        return c.prefill_tokens_per_s if c.prefill_tokens_per_s > 0 else fallback

    tier_aware = True  # count what lower tiers hold (kv_aware_t0: not)

    def lower_tier_plan(self, c: InstanceSnapshot, num_prompt_tokens: int, rate: float) -> tuple[int, float, float]:
        """For the prompt tokens ``c`` can load from its lower tiers (beyond its in-memory match, never the
        last prompt token, which is always computed): ``(tokens loaded, seconds loading them, seconds of
        recompute they save net of the load)``. Loading stops at the first tier without a measured speed
        (predicted as recomputed: the conservative side). Nothing for a policy that is not ``tier_aware``."""
        if not self.tier_aware or not c.lower_matched:
            return 0, 0.0, 0.0
        speeds = dict(c.tier_load_tokens_per_s)
        room = max(num_prompt_tokens - 1 - c.matched_tokens, 0)
        loaded, seconds, saved = 0, 0.0, 0.0
        for tier, tokens in c.lower_matched:
            speed = speeds.get(tier, 0.0)
            take = min(tokens, room - loaded)
            if speed <= 0 or take <= 0:
                break
            loaded += take
            seconds += take / speed
            saved += max(take / rate - take / speed, 0.0)
        return loaded, seconds, saved

    @staticmethod
    def _running(c: InstanceSnapshot) -> int:
        return max(c.num_running, c.inflight - c.num_waiting)  # a heartbeat is up to an interval old

    @classmethod
    def model_rate(cls, c: InstanceSnapshot, num_prompt_tokens: int, model: StepTimeModel) -> float:
        """Prefill tokens/s ``model`` predicts on ``c`` for a whole prompt of ``num_prompt_tokens`` (what
        recomputing a prompt's tokens costs there, per token)."""
        n = max(num_prompt_tokens, 1)
        seconds = model.prefill_seconds(n, 0, c.token_budget, cls._running(c), c.decode_context_tokens)
        return n / seconds if seconds > 0 else math.inf

    def predicted_latency(self, c: InstanceSnapshot, num_prompt_tokens: int, rate: float,
                          model: StepTimeModel | None = None) -> float:
        """Seconds to ``c``'s first token for a request of ``num_prompt_tokens``: with a step-time
        ``model``, the queued prefill work (taken as prompts of this one's size) and then this prompt's
        uncached tokens, chunked by ``c``'s token budget beside its decode rows; without one, that work
        plus ``decode_weight`` tokens per running request over ``rate`` (tokens/s). ``rate`` also prices
        the tokens a lower tier would load instead."""
        loaded, load_seconds, _ = self.lower_tier_plan(c, num_prompt_tokens, rate)
        cached = c.matched_tokens + loaded
        uncached = max(num_prompt_tokens - cached, 1)
        running = self._running(c)
        if not c.adapter_resident:  # its adapter is read into a slot first
            load_seconds += c.adapter_load_seconds
        if model is not None:
            return model.ttft(num_prompt_tokens, c.pending_prefill_tokens, min(cached, num_prompt_tokens - 1),
                              c.token_budget, running, c.decode_context_tokens,
                              queued_prompt_tokens=num_prompt_tokens) + load_seconds
        work = c.pending_prefill_tokens + uncached + self.decode_weight * running
        return work / rate + load_seconds

    def reuse(self, c: InstanceSnapshot, num_prompt_tokens: int, rate: float) -> float:
        """The cache-reuse term's tokens: the in-memory match, plus the lower-tier tokens weighted by the
        share of their recompute time loading them saves."""
        saved = self.lower_tier_plan(c, num_prompt_tokens, rate)[2]
        return min(c.matched_tokens + saved * rate, num_prompt_tokens)

    def overloaded(self, c: InstanceSnapshot) -> bool:
        return c.num_waiting >= self.max_waiting or c.kv_usage >= self.kv_high_watermark or not c.adapter_slot_free

    # ---- sessions -----------------------------------------------------------------------------
    def _session_instance(self, session_id: str | None) -> str | None:
        if not session_id:
            return None
        entry = self._sessions.get(session_id)
        if entry is None:
            return None
        instance, seen = entry
        if self._clock() - seen > self.session_ttl:
            del self._sessions[session_id]
            return None
        return instance

    def _remember(self, session_id: str | None, instance_id: str) -> None:
        if not session_id:
            return
        self._sessions[session_id] = (instance_id, self._clock())
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def forget_instance(self, instance_id: str) -> None:
        for sid in [s for s, (w, _) in self._sessions.items() if w == instance_id]:
            del self._sessions[sid]

    # ---- the decision -----------------------------------------------------------------------
    def route(self, request: RouteRequest, candidates: Sequence[InstanceSnapshot]) -> RouteDecision:
        _check(candidates)
        ordered = sorted(load_as_seen_by(request, candidates), key=lambda c: c.instance_id)
        length = max(request.num_prompt_tokens, 1)
        shared = None  # the model of an instance without one yet: its peers' mean
        if any(c.step_model is None for c in ordered):
            reported = [c.step_model for c in ordered if c.step_model is not None]
            shared = mean_model(reported) if reported else None
        models = {c.instance_id: c.step_model or shared for c in ordered}
        measured = [c.prefill_tokens_per_s for c in ordered if c.prefill_tokens_per_s > 0]
        fallback_rate = sum(measured) / len(measured) if measured else self.default_prefill_rate
        # a model's rate prices lower-tier loads only (a candidate with none: nothing to price)
        rates = {c.instance_id: (self.model_rate(c, length, m) if c.lower_matched else 0.0)
                 if (m := models[c.instance_id]) is not None else self._rate(c, fallback_rate) for c in ordered}
        latency = {c.instance_id: self.predicted_latency(c, length, rates[c.instance_id], models[c.instance_id])
                   for c in ordered}
        pool = [c for c in ordered if not self.overloaded(c)] or ordered
        max_latency = max(latency[c.instance_id] for c in pool) or 1.0
        fastest = min(pool, key=lambda c: (latency[c.instance_id], c.outstanding))
        limit = self.fallback_ratio * latency[fastest.instance_id] + self.fallback_slack

        def acceptable(instance_id: str) -> bool:
            return latency[instance_id] <= limit

        reuse = {c.instance_id: self.reuse(c, length, rates[c.instance_id]) for c in ordered}
        scores = {c.instance_id: self.alpha * reuse[c.instance_id] / length
                  - self.gamma * latency[c.instance_id] / max_latency for c in pool}
        sticky = self._session_instance(request.session_id)
        if sticky is not None and sticky in scores and acceptable(sticky):
            choice, reason = sticky, "session"
        else:
            # exact ties (typically a new prefix on idle instances): the emptier cache, then in turn, so that
            # distinct prefixes spread over the instances and their caches add up
            turn = next(self._turn)
            rank = {c.instance_id: (i - turn) % len(pool) for i, c in enumerate(pool)}
            best = max(pool, key=lambda c: (round(scores[c.instance_id], 9), -c.outstanding, -c.cached_blocks,
                                            -rank[c.instance_id]))
            choice = best.instance_id
            reason = "kv_cache" if reuse[choice] > 0 else "least_latency"
            if not acceptable(choice):
                choice, reason = fastest.instance_id, "load_fallback"
        self._remember(request.session_id, choice)
        return RouteDecision(choice, reason, latency[choice], scores)


class MemoryOnlyKVAwarePolicy(KVCacheAwarePolicy):
    """``kv_aware_t0``: :class:`KVCacheAwarePolicy` that counts only the prefix an instance holds in its KV
    memory, as if it had no lower tiers (what routing was before it knew them; the benchmark's baseline)."""

    name = "kv_aware_t0"
    tier_aware = False
