"""Routing glue: prompt -> block hashes -> global KV index match -> policy -> instance.

The policy itself is pure logic in :mod:`xllm.sched.routing`; this module builds its inputs
from the registry (each instance's last heartbeat) and from what this gateway dispatched and
has not yet seen answered (heartbeats are up to an interval old; a burst of requests must see
the ones sent a moment ago), and keeps that accounting as requests start and finish.

PD mode: when a model has live prefill and decode instances, :meth:`Router.route_pd` places each
request on a pair (:class:`xllm.sched.PDPlacement`), with the prefix each side holds matched in
the same global KV index (both roles publish their caches). The index also says how much more of the
prompt an instance could load from its lower KV tiers (host DRAM, disk, the cluster store); the
snapshot carries that with each tier's measured load speed, and the policy weighs it by predicted
TTFT against recomputing (:mod:`xllm.sched.routing`). An instance whose role is flipping
(dynamic PD, :mod:`xllm.gateway.roles`) is in neither pool and gets no moved requests. The latencies
the role policy reads are measured here too (:attr:`Router.latency`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from xllm.gateway.registry.base import InstanceState, NoInstanceError, Registry
from xllm.gateway.roles import LatencyTracker
from xllm.kvstore import block_hashes
from xllm.kvstore.hashing import ROOT_HASH
from xllm.sched import (
    ROUTING_POLICIES,
    InstanceSnapshot,
    KVCacheAwarePolicy,
    PDPlacement,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
)
from xllm.sched.latency import StepTimeModel, predictor_from_report

log = logging.getLogger(__name__)



class RecentLatencies:
    """The latencies clients saw over the last ``horizon`` seconds, for the live cluster page's percentiles
    and SLO attainment (:mod:`xllm.gateway.dashboard`): ``ttft`` one sample per request (its first chunk,
    as ``xllm:router_time_to_first_token_seconds`` counts it), ``tpot`` one per streamed chunk (seconds per
    token, as :meth:`Router.observe_tpot` gets them), ``e2e`` one per finished request. At most
    ``max_samples`` of each are kept (the oldest dropped first)."""

    KINDS = ("ttft", "tpot", "e2e")

    def __init__(self, horizon: float = 300.0, max_samples: int = 20000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.horizon = horizon
        self.clock = clock
        self._samples: dict[str, deque[tuple[float, float]]] = {k: deque(maxlen=max_samples) for k in self.KINDS}

    def add(self, kind: str, seconds: float) -> None:
        self._samples[kind].append((self.clock(), seconds))

    def samples(self, kind: str) -> list[tuple[float, float]]:
        """(clock time, seconds) of ``kind`` within the horizon, oldest first."""
        window = self._samples[kind]
        cutoff = self.clock() - self.horizon
        while window and window[0][0] < cutoff:
            window.popleft()
        return list(window)

    def values(self, kind: str) -> list[float]:
        """The samples of ``kind`` within the horizon, oldest first."""
        return [v for _, v in self.samples(kind)]


@dataclass
class PromptMatch:
    """The prompt's block hashes per block size and, per candidate instance, how much of the prompt it
    holds: ``device`` tokens in its KV memory, then ``lower`` (tier, tokens) it could load from its lower
    tiers (:meth:`xllm.kvstore.GlobalKVIndex.match_tiers`); ``lora``: the request's adapter ("": the base model)."""

    lora: str = ""
    hashes_by_bs: dict[int, list[int]] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)
    lower: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)

    def reused_tokens(self, instance_id: str) -> int:
        """Prompt tokens the instance would not compute: in memory or loaded from a lower tier."""
        return self.device.get(instance_id, 0) + sum(n for _, n in self.lower.get(instance_id, ()))


@dataclass
class Ticket:
    """One routing decision and the accounting it holds on its instance."""

    state: InstanceState
    decision: RouteDecision
    num_prompt_tokens: int
    matched_tokens: int  # prompt tokens the instance reuses (in its memory or loaded from a lower tier)
    hashes: list[int] = field(default_factory=list)
    requests: int = 0
    first_token_pending: int = 0
    started: float = field(default_factory=time.monotonic)
    offline: bool = False  # co-location's best-effort work (accounted apart: online requests see online load)
    # whether the instance computes the prompt: False for the decode side of a PD pair, which reserves KV
    # and waits for the hand-off (its requests are no prefill work queued there: PD placement's overflow
    # predicts a decode instance's TTFT from what it has to prefill itself)
    prefills: bool = True

    @property
    def uncached_tokens(self) -> int:
        return max(self.num_prompt_tokens - self.matched_tokens, 0)

    @property
    def queued_prefill(self) -> tuple[int, int]:
        """(uncached, whole) prompt tokens one of its requests queues on the instance until its first token."""
        return (self.uncached_tokens, self.num_prompt_tokens) if self.prefills else (0, 0)


def _serves(state: InstanceState, lora: str) -> bool:
    """Whether ``state`` can serve a request of the adapter ``lora`` ("": the base model)."""
    return not lora or lora in state.adapters()


def _root(candidates: list[InstanceState], lora: str) -> int:
    """Where the KV block hashes of a request of ``lora`` chain from (the adapter's identity, the same on every
    instance that has the same adapter files; the base model's: :data:`ROOT_HASH`)."""
    return candidates[0].adapters()[lora] if lora and candidates else ROOT_HASH


def _what(model: str, lora: str) -> str:
    return f"{model!r} with the adapter {lora!r}" if lora else repr(model)


def _policy(name: str, fallback_ratio: float | None) -> RoutingPolicy:
    """The routing policy ``name``; a KV-aware one with ``fallback_ratio`` (where given)."""
    cls = ROUTING_POLICIES.get(name)
    if fallback_ratio is not None and issubclass(cls, KVCacheAwarePolicy):
        return cls(fallback_ratio=fallback_ratio)
    return cls()


class Router:
    """Chooses instances with a routing policy and tracks the load it sends them."""

    def __init__(self, registry: Registry, policy: RoutingPolicy | str = "kv_aware", expect_ttl: float = 2.0,
                 queued_expect_ttl: float = 120.0, metrics=None, pd_slo_ttft_s: float | None = None,
                 pd_predictor: StepTimeModel | None = None, fallback_ratio: float | None = None) -> None:
        """``pd_slo_ttft_s`` (with ``pd_predictor``, optional): PD placement overflows a request onto a
        decode instance when every prefill instance is predicted to miss this TTFT objective.
        ``fallback_ratio``: a KV-aware policy's load fallback (``--routing-fallback-ratio``; None: its default)."""
        self.registry = registry
        self.policy = _policy(policy, fallback_ratio) if isinstance(policy, str) else policy
        self.placement = PDPlacement(_policy(policy, fallback_ratio) if isinstance(policy, str) else None,
                                     slo_ttft_s=pd_slo_ttft_s, predictor=pd_predictor)
        self.expect_ttl = expect_ttl              # after the first token: until heartbeats confirm the blocks
        self.queued_expect_ttl = queued_expect_ttl  # before it: the request may wait in the engine's queue
        self.metrics = metrics
        self.latency = LatencyTracker()  # TTFT / TPOT per instance, as this gateway measured them
        self.recent = RecentLatencies()  # what clients saw, the last minutes (the live cluster page)
        registry.add_listener(self._on_registry_event)

    def _on_registry_event(self, event: str, state: InstanceState) -> None:
        if event == "removed":
            self.policy.forget_instance(state.instance_id)
            self.placement.forget_instance(state.instance_id)
            self.latency.forget(state.instance_id)

    # ---- deciding ---------------------------------------------------------------------------
    def route(self, model: str, prompt: Sequence[int], session: str | None = None,
              exclude: Collection[str] = (), offline: bool = False, lora: str = "") -> Ticket:
        """Pick an instance of ``model`` for ``prompt`` (raises :class:`NoInstanceError`); an online
        request (not ``offline``) is routed on the instances' online load only
        (:func:`xllm.sched.routing.load_as_seen_by`).

        With a single candidate (one machine, one engine) there is nothing to choose: no prefix
        hashing, no index match, no policy. Encode instances (EPD) take no requests."""
        candidates = [s for s in self.registry.routable(model)
                      if s.instance_id not in exclude and s.role != "encode" and _serves(s, lora)]
        if not candidates:
            raise NoInstanceError(f"no live instance serves {_what(model, lora)}")
        return self._route_among(candidates, prompt, session, offline, lora)

    def route_move(self, model: str, tokens: Sequence[int], exclude: Collection[str] = (), lora: str = "") -> Ticket:
        """An instance to continue a running request on (its tokens so far): one that decodes (a
        mixed or decode instance), not in ``exclude`` (raises :class:`NoInstanceError`)."""
        candidates = [s for s in self.registry.routable(model)
                      if s.instance_id not in exclude and s.role in ("mixed", "decode") and s.flip is None
                      and _serves(s, lora)]
        if not candidates:
            raise NoInstanceError(f"no other live instance decodes {_what(model, lora)}")
        return self._route_among(candidates, tokens, None, lora=lora)

    def fastest_prefill(self, model: str) -> float:
        """The highest prefill speed (tokens/s) a live instance of ``model`` measured (0: none has)."""
        return max((s.load.prefill_tokens_per_s for s in self.registry.routable(model) if s.load is not None),
                   default=0.0)

    def _route_among(self, candidates: list[InstanceState], prompt: Sequence[int], session: str | None,
                     offline: bool = False, lora: str = "") -> Ticket:
        if len(candidates) == 1:
            return Ticket(candidates[0], RouteDecision(candidates[0].instance_id, "only"), len(prompt), 0,
                          offline=offline)
        match = self._match(candidates, prompt, lora)
        snaps = [self._snapshot(s, match) for s in candidates]
        decision = self.policy.route(RouteRequest(len(prompt), session, offline=offline), snaps)
        ticket = self._ticket(candidates, decision, prompt, match)
        ticket.offline = offline
        return ticket

    # ---- PD mode ------------------------------------------------------------------------------
    def pd_pools(self, model: str, exclude: Collection[str] = (),
                 lora: str = "") -> tuple[list[InstanceState], list[InstanceState]]:
        """The live prefill and decode instances of ``model`` (with the adapter ``lora``: those that have it;
        PD mode when both are non-empty); an instance flipping role is in neither."""
        live = [s for s in self.registry.routable(model)
                if s.instance_id not in exclude and s.flip is None and _serves(s, lora)]
        return [s for s in live if s.role == "prefill"], [s for s in live if s.role == "decode"]

    def route_pd(self, model: str, prompt: Sequence[int], max_new_tokens: int, session: str | None = None,
                 exclude: Collection[str] = (), lora: str = "") -> tuple[Ticket, Ticket]:
        """A (prefill, decode) pair for ``prompt`` (raises :class:`NoInstanceError` without one of each);
        one ticket twice when the placement runs it whole on a decode instance (prefill overflow)."""
        prefills, decodes = self.pd_pools(model, exclude, lora)
        if not prefills or not decodes:
            raise NoInstanceError(f"no live prefill and decode instances serve {_what(model, lora)}")
        match = self._match(prefills + decodes, prompt, lora)
        request = RouteRequest(len(prompt), session, max_new_tokens)
        decision = self.placement.route(request, [self._snapshot(s, match) for s in prefills],
                                        [self._snapshot(s, match) for s in decodes])
        decode = self._ticket(decodes, decision.decode, prompt, match)
        if decision.local:
            return decode, decode
        decode.prefills = False
        return self._ticket(prefills, decision.prefill, prompt, match), decode

    def route_prefill(self, model: str, prompt: Sequence[int], session: str | None = None,
                      exclude: Collection[str] = (), lora: str = "") -> Ticket:
        """Another prefill instance for a request whose decode side is already reserved."""
        prefills, _ = self.pd_pools(model, exclude, lora)
        if not prefills:
            raise NoInstanceError(f"no live prefill instance serves {_what(model, lora)}")
        match = self._match(prefills, prompt, lora)
        snaps = [self._snapshot(s, match) for s in prefills]
        decision = self.placement.prefill_policy.route(RouteRequest(len(prompt), session), snaps)
        return self._ticket(prefills, decision, prompt, match)

    def _match(self, candidates: list[InstanceState], prompt: Sequence[int], lora: str = "") -> PromptMatch:
        """The prompt's block hashes per block size (chained from the root of the adapter ``lora``: an adapter's KV
        is its own), and the prefix each candidate holds (in memory and in its lower KV tiers)."""
        match = PromptMatch(lora)
        root = _root(candidates, lora)
        for bs in {s.block_size for s in candidates if s.block_size > 0}:
            hashes = match.hashes_by_bs[bs] = block_hashes(prompt, bs, parent=root)
            ids = {s.instance_id for s in candidates if s.block_size == bs}
            for iid, reach in self.registry.kv_index.match_tiers(hashes, ids).items():
                match.device[iid] = reach.device * bs
                if reach.lower:
                    match.lower[iid] = tuple((tier, n * bs) for tier, n in reach.lower)
        return match

    def _snapshot(self, s: InstanceState, match: PromptMatch) -> InstanceSnapshot:
        return self.snapshot(s, match.device.get(s.instance_id, 0), match.lower.get(s.instance_id, ()), match.lora)

    @staticmethod
    def _ticket(candidates: list[InstanceState], decision: RouteDecision, prompt: Sequence[int],
                match: PromptMatch) -> Ticket:
        state = next(s for s in candidates if s.instance_id == decision.instance_id)
        return Ticket(state, decision, len(prompt), min(match.reused_tokens(state.instance_id), len(prompt)),
                      match.hashes_by_bs.get(state.block_size, []))

    def snapshot(self, s: InstanceState, matched_tokens: int,
                 lower_matched: tuple[tuple[str, int], ...] = (), lora: str = "") -> InstanceSnapshot:
        """What the policies see of ``s``: its last load report and this gateway's requests on it, with
        ``matched_tokens`` of the prompt in its memory and then ``lower_matched`` (tier, tokens) it can load;
        for a request of the adapter ``lora``, whether the adapter is resident there and a slot could take it."""
        load = s.load
        resident = not lora or load is None or lora in load.lora_resident
        # The engine reports the whole prompts of its queued requests (it cannot know their cache hits
        # before admission); this gateway knows its own requests' uncached part exactly. Queued work =
        # ours (uncached) + the rest of the report (other gateways' requests).
        reported_pending = load.pending_prefill_tokens if load is not None else 0
        others = max(reported_pending - s.pending_prompt, 0)
        return InstanceSnapshot(
            instance_id=s.instance_id,
            num_running=load.num_running if load is not None else 0,
            num_waiting=load.num_waiting if load is not None else 0,
            kv_usage=load.kv_usage if load is not None else 0.0,
            pending_prefill_tokens=s.pending_prefill + others,
            prefill_tokens_per_s=load.prefill_tokens_per_s if load is not None else 0.0,
            recent_ttft=load.recent_ttft if load is not None else 0.0,
            recent_tpot=load.recent_tpot if load is not None else 0.0,
            inflight=s.inflight, matched_tokens=matched_tokens, lower_matched=lower_matched,
            tier_load_tokens_per_s=tuple(sorted(load.tier_load_tokens_per_s.items())) if load is not None else (),
            kv_free_tokens=load.kv_free_tokens if load is not None else -1,
            cached_blocks=self.registry.kv_index.num_blocks(s.instance_id),
            offline_running=load.offline_running if load is not None else 0,
            offline_waiting=load.offline_waiting if load is not None else 0, offline_inflight=s.off_inflight,
            offline_pending_prefill_tokens=s.off_pending_prefill + max(
                (load.offline_pending_prefill_tokens if load is not None else 0) - s.off_pending_prompt, 0),
            step_model=predictor_from_report(load.step_predictor) if load is not None else None,
            token_budget=load.step_predictor.token_budget if load is not None else 0,
            decode_context_tokens=load.decode_context_tokens if load is not None else 0,
            adapter_resident=resident, adapter_load_seconds=load.lora_load_seconds if load is not None else 0.0,
            adapter_slot_free=resident or load.lora_slots_free > 0)

    # ---- accounting ----------------------------------------------------------------------------
    def dispatched(self, ticket: Ticket, num_requests: int) -> None:
        """``num_requests`` (the choices of one API request) were accepted by the ticket's instance."""
        s = ticket.state
        ticket.requests = num_requests
        ticket.first_token_pending = num_requests
        s.inflight += num_requests
        uncached, whole = ticket.queued_prefill
        s.pending_prefill += uncached * num_requests
        s.pending_prompt += whole * num_requests
        if ticket.offline:
            s.off_inflight += num_requests
            s.off_pending_prefill += uncached * num_requests
            s.off_pending_prompt += whole * num_requests
        if ticket.hashes:
            self.registry.kv_index.expect(s.instance_id, ticket.hashes, self.queued_expect_ttl)
        if s.role != "decode":  # the prefill sizes the role policy predicts TTFT with
            self.latency.prompt(s.instance_id, ticket.uncached_tokens)
        if self.metrics is not None:
            self.metrics.routed(s.model, s.instance_id, ticket.decision.reason, ticket.num_prompt_tokens,
                                ticket.matched_tokens, num_requests)

    def first_token(self, ticket: Ticket, observe: bool = True) -> None:
        """One of the ticket's requests produced its first chunk (its prefill is done), or ended
        without one (``observe=False``): its prefill no longer waits on the instance."""
        if ticket.first_token_pending <= 0:
            return
        ticket.first_token_pending -= 1
        s = ticket.state
        uncached, whole = ticket.queued_prefill
        s.pending_prefill = max(s.pending_prefill - uncached, 0)
        s.pending_prompt = max(s.pending_prompt - whole, 0)
        if ticket.offline:
            s.off_pending_prefill = max(s.off_pending_prefill - uncached, 0)
            s.off_pending_prompt = max(s.off_pending_prompt - whole, 0)
        if ticket.hashes and not s.removed:  # computed now (or abandoned): heartbeats take over shortly
            self.registry.kv_index.expect(s.instance_id, ticket.hashes, self.expect_ttl)
        if observe:
            self.recent.add("ttft", time.monotonic() - ticket.started)
        if observe and self.metrics is not None:
            self.metrics.first_token(ticket.state.model, ticket.state.instance_id, time.monotonic() - ticket.started)

    @staticmethod
    def hold_prefill(state: InstanceState, tokens: int) -> None:
        """Count ``tokens`` of prefill as queued on ``state`` before a request is placed there (a
        move decided but not yet dispatched); a negative count gives them back."""
        state.pending_prefill = max(state.pending_prefill + tokens, 0)

    def finished(self, ticket: Ticket, got_first_token: bool = True) -> None:
        """One of the ticket's requests ended (finished, failed or was abandoned)."""
        if ticket.requests <= 0:
            return
        if not got_first_token:
            self.first_token(ticket, observe=False)
        ticket.requests -= 1
        s = ticket.state
        s.inflight = max(s.inflight - 1, 0)
        if ticket.offline:
            s.off_inflight = max(s.off_inflight - 1, 0)
        if s.removed and s.inflight == 0:
            self.registry.close_client(s)

    def failed(self, state: InstanceState) -> None:
        """A request could not be served by ``state`` (unreachable, hung, crashed, draining): its
        circuit breaker opens (no requests until the backoff is over and a health probe passes)."""
        state.breaker.failure(self.registry.clock())
        if self.metrics is not None:
            self.metrics.failure(state.model, state.instance_id)

    @staticmethod
    def succeeded(state: InstanceState) -> None:
        """``state`` served a request (its first token came): its consecutive failures are forgiven."""
        if state.breaker.failures:
            state.breaker.success()

    def served(self, ticket: Ticket) -> None:
        """One of the ticket's requests streamed its first chunk: its prefill no longer waits on the
        instance (:meth:`first_token`) and the instance's consecutive failures are forgiven
        (:meth:`succeeded`)."""
        self.first_token(ticket)
        self.succeeded(ticket.state)

    # ---- latencies this gateway measures (read by the role policy: :mod:`xllm.gateway.roles`) ------
    def observe_ttft(self, state: InstanceState, seconds: float) -> None:
        """A time to first token of a request ``state`` prefilled."""
        self.latency.ttft(state.instance_id, seconds)

    def observe_tpot(self, state: InstanceState, seconds: float) -> None:
        """A time per output token of a chunk ``state`` streamed."""
        self.latency.tpot(state.instance_id, seconds)
        self.recent.add("tpot", seconds)
        if self.metrics is not None:
            self.metrics.time_per_output_token(state.model, state.instance_id, seconds)

    def completed(self, state: InstanceState, reason: str, seconds: float) -> None:
        """A request ended with ``reason`` on ``state``, ``seconds`` after it reached the gateway."""
        self.recent.add("e2e", seconds)
        if self.metrics is not None:
            self.metrics.finished(state.model, state.instance_id, reason, seconds)
