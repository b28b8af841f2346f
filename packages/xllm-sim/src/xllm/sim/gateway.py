"""The simulated gateway: what it knows of each instance and how it asks the real policies.

As ``xllm.gateway.router.Router`` does, it builds one :class:`xllm.sched.InstanceSnapshot` per
candidate — the instance's last load report (refreshed every ``heartbeat_s``; live when 0) plus
the requests this gateway sent there and has not seen finish (``inflight``) and their uncached
prompt tokens not yet past their first token (``pending_prefill``) — with the prompt tokens the
global KV index says the candidate holds, and asks ``xllm.sched`` (a routing policy, or
``PDPlacement`` in PD mode).

The global KV index maps each shared-prefix block hash to the instances caching it. It is told of
every block an instance caches or evicts when it happens (the live gateway learns it up to a
heartbeat later), and, like ``GlobalKVIndex.expect``, counts the prefix blocks of a request
routed to an instance as held there until that instance computes them (or ``expect_ttl`` passes),
so a burst sharing a new prefix follows its first request.
"""

from __future__ import annotations

from collections.abc import Sequence

from xllm.sched import InstanceSnapshot, PDPlacement, RouteRequest, RoutingPolicy
from xllm.sched.elastic import WindowMean
from xllm.sim.instance import DECODE, PREFILL, SimInstance
from xllm.sim.kvcache import block_hash
from xllm.sim.metrics import Request

PROMPT_WINDOW_S = 10.0  # the live gateway's --pd latency window default (PDRoleOptions.latency_window_s)


class InstanceView:
    """The gateway's side of one instance: its accounting and its last load report."""

    __slots__ = ("inflight", "inst", "off_inflight", "off_pending_prefill", "off_pending_prompt", "pending_prefill",
                 "pending_prompt", "prompts", "report", "snap")

    def __init__(self, inst: SimInstance) -> None:
        self.inst = inst
        self.inflight = 0
        self.pending_prefill = 0
        self.pending_prompt = 0
        # the offline share of the three above (co-location: online requests are routed on online load)
        self.off_inflight = 0
        self.off_pending_prefill = 0
        self.off_pending_prompt = 0
        self.report: tuple = (0, 0, 0.0, inst.kv.num_blocks * inst.kv.block_size, 0, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0)
        self.snap: InstanceSnapshot | None = None
        # prompt tokens to compute of the requests sent here to prefill, as the live gateway's
        # LatencyTracker keeps them for the role policy (its 10 s window)
        self.prompts = WindowMean(PROMPT_WINDOW_S)


def live_report(inst: SimInstance) -> tuple:
    """What the instance's heartbeat carries: (running, waiting, KV usage, KV free tokens, pending
    prefill tokens, prefill tokens/s, recent TTFT, recent TPOT, cached blocks, the offline share
    of running, waiting and pending prefill tokens, and the context the running requests attend to)."""
    kv = inst.kv
    pending, off_pending, off_running, off_waiting = inst.load_counts()
    return (len(inst.running), len(inst.waiting) + len(inst.reserving), kv.usage, kv.available * kv.block_size,
            pending, inst.prefill_tps, inst.recent_ttft, inst.recent_tpot, len(kv.refs),
            off_running, off_waiting, off_pending, sum(s.num_tokens for s in inst.running))


class Gateway:
    """Routing and placement over the instances (see the module docstring)."""

    def __init__(self, instances: Sequence[SimInstance], policy: RoutingPolicy, placement: PDPlacement,
                 heartbeat_s: float, expect_ttl: float = 120.0) -> None:
        self.instances = list(instances)
        self.views = [InstanceView(i) for i in instances]
        self.policy, self.placement = policy, placement
        self.live = heartbeat_s <= 0
        self.expect_ttl = expect_ttl
        self.index: dict[int, set[int]] = {}
        self.expected: dict[int, dict[int, float]] = {}
        self.now = 0.0
        if not self.live:
            for v in self.views:
                self.heartbeat(v.inst.index)

    # ---- what the gateway hears -------------------------------------------------------------------
    def kv_event(self, index: int, stored: bool, block_hash: int) -> None:
        """Instance ``index`` cached (``stored``) or evicted a shared-prefix block."""
        if stored:
            self.index.setdefault(block_hash, set()).add(index)
            exp = self.expected.get(block_hash)
            if exp is not None and exp.pop(index, None) is not None and not exp:
                del self.expected[block_hash]
        else:
            holders = self.index.get(block_hash)
            if holders is not None:
                holders.discard(index)
                if not holders:
                    del self.index[block_hash]

    def heartbeat(self, index: int) -> None:
        view = self.views[index]
        view.report = live_report(view.inst)
        view.snap = None

    def snapshot_report(self, view: InstanceView) -> tuple:
        """The instance's last load report (live state when ``heartbeat_s`` is 0)."""
        return live_report(view.inst) if self.live else view.report

    # ---- snapshots ----------------------------------------------------------------------------------------
    def snapshot(self, view: InstanceView) -> InstanceSnapshot:
        """The candidate as the policies see it (matched tokens 0)."""
        if view.snap is not None and not self.live:
            return view.snap
        running, waiting, usage, free, pending, tps, ttft, tpot, cached, off_run, off_wait, off_pending, context = \
            self.snapshot_report(view)
        others = max(pending - view.pending_prompt, 0)  # queued work of requests this gateway did not send
        off_others = max(off_pending - view.off_pending_prompt, 0)
        inst = view.inst
        view.snap = InstanceSnapshot(inst.instance_id, running, waiting, usage, view.pending_prefill + others,
                                     tps, ttft, tpot, view.inflight, 0, cached, free, off_run, off_wait,
                                     view.off_inflight, view.off_pending_prefill + off_others,
                                     step_model=inst.predictor, token_budget=inst.token_budget,
                                     decode_context_tokens=context)
        return view.snap

    def snapshots(self, views: Sequence[InstanceView], matched: dict[int, int]) -> list[InstanceSnapshot]:
        out = []
        for v in views:
            snap = self.snapshot(v)
            m = matched.get(v.inst.index)
            if m:  # dataclasses.replace is 4x slower than building it again
                snap = InstanceSnapshot(snap.instance_id, snap.num_running, snap.num_waiting, snap.kv_usage,
                                        snap.pending_prefill_tokens, snap.prefill_tokens_per_s, snap.recent_ttft,
                                        snap.recent_tpot, snap.inflight, m, snap.cached_blocks, snap.kv_free_tokens,
                                        snap.offline_running, snap.offline_waiting, snap.offline_inflight,
                                        snap.offline_pending_prefill_tokens, step_model=snap.step_model,
                                        token_budget=snap.token_budget,
                                        decode_context_tokens=snap.decode_context_tokens)
            out.append(snap)
        return out

    def match(self, req: Request, views: Sequence[InstanceView]) -> dict[int, int]:
        """Instance index -> leading prompt tokens it holds (confirmed or expected), for ``views``."""
        spec = req.spec
        bs = req.block_size
        shared = min(spec.prefix_len, spec.prompt_len) // bs
        if spec.prefix_group < 0 or shared == 0:
            return {}
        wanted = {v.inst.index for v in views}
        matched: dict[int, int] = {}
        alive: set[int] | None = None
        for j in range(shared):
            h = block_hash(spec.rid, spec.prefix_group, shared, j)
            holders = self.index.get(h, set()) & wanted if alive is None else self.index.get(h, set()) & alive
            exp = self.expected.get(h)
            if exp:
                live = {i for i, until in exp.items() if until > self.now}
                if len(live) < len(exp):
                    for i in [i for i in exp if i not in live]:
                        del exp[i]
                holders |= live & (wanted if alive is None else alive)
            if alive is not None:
                for i in alive - holders:
                    matched[i] = j * bs
            alive = holders
            if not alive:
                break
        for i in alive or ():
            matched[i] = shared * bs
        return matched

    # ---- decisions ------------------------------------------------------------------------------------------
    def pools(self) -> tuple[list[InstanceView], list[InstanceView]]:
        """The prefill and decode instances that take new work (a flipping instance takes none)."""
        return ([v for v in self.views if v.inst.role == PREFILL and v.inst.flipping is None],
                [v for v in self.views if v.inst.role == DECODE and v.inst.flipping is None])

    def route(self, req: Request, views: Sequence[InstanceView]) -> tuple[InstanceView, int]:
        """An instance for ``req`` among ``views`` and the prompt tokens it holds."""
        if len(views) == 1:
            return views[0], 0
        matched = self.match(req, views)
        decision = self.policy.route(RouteRequest(req.spec.prompt_len, offline=req.spec.offline),
                                     self.snapshots(views, matched))
        view = self._by_id(views, decision.instance_id)
        return view, matched.get(view.inst.index, 0)

    def route_pd(self, req: Request, prefills: Sequence[InstanceView],
                 decodes: Sequence[InstanceView]) -> tuple[InstanceView, int, InstanceView]:
        """(prefill instance, the prompt tokens it holds, decode instance) for ``req``; the decode
        instance both times when the placement overflows the prefill onto it (``PDDecision.local``)."""
        matched = self.match(req, [*prefills, *decodes])
        spec = req.spec
        decision = self.placement.route(RouteRequest(spec.prompt_len, None, spec.output_len),
                                        self.snapshots(prefills, matched), self.snapshots(decodes, matched))
        d = self._by_id(decodes, decision.decode.instance_id)
        p = d if decision.local else self._by_id(prefills, decision.prefill.instance_id)
        return p, matched.get(p.inst.index, 0), d

    @staticmethod
    def _by_id(views: Sequence[InstanceView], instance_id: str) -> InstanceView:
        for v in views:
            if v.inst.instance_id == instance_id:
                return v
        raise KeyError(instance_id)

    # ---- accounting (as Router.dispatched / first_token / finished) -----------------------------------------
    def dispatched(self, view: InstanceView, req: Request, matched: int, prefill: bool = True) -> None:
        offline = req.spec.offline
        view.inflight += 1
        view.off_inflight += offline
        if prefill:
            spec = req.spec
            uncached = max(spec.prompt_len - matched, 0)
            view.pending_prefill += uncached
            view.pending_prompt += spec.prompt_len
            if offline:
                view.off_pending_prefill += uncached
                view.off_pending_prompt += spec.prompt_len
            if view.inst.role != DECODE:
                view.prompts.add(self.now, uncached)
            self._expect(req, view.inst.index)
        view.snap = None

    def first_token(self, view: InstanceView, req: Request) -> None:
        spec = req.spec
        uncached = max(spec.prompt_len - req.matched_tokens, 0)
        view.pending_prefill = max(view.pending_prefill - uncached, 0)
        view.pending_prompt = max(view.pending_prompt - spec.prompt_len, 0)
        if spec.offline:
            view.off_pending_prefill = max(view.off_pending_prefill - uncached, 0)
            view.off_pending_prompt = max(view.off_pending_prompt - spec.prompt_len, 0)
        view.snap = None

    def finished(self, view: InstanceView, req: Request) -> None:
        view.inflight = max(view.inflight - 1, 0)
        if req.spec.offline:
            view.off_inflight = max(view.off_inflight - 1, 0)
        view.snap = None

    def _expect(self, req: Request, index: int) -> None:
        spec = req.spec
        shared = min(spec.prefix_len, spec.prompt_len) // req.block_size
        if spec.prefix_group < 0 or not shared:
            return
        until = self.now + self.expect_ttl
        for j in range(shared):
            h = block_hash(spec.rid, spec.prefix_group, shared, j)
            if index not in self.index.get(h, ()):
                self.expected.setdefault(h, {})[index] = until
