"""Role flips in a simulated PD cluster, decided by the real role policy (``xllm.sched.PD_POLICIES``).

Every ``pd_interval_s`` the gateway builds one :class:`xllm.sched.elastic.RoleLoad` per PD instance
from its load report (queue, prefill speed, and TTFT/TPOT as the engine measures them: a PD
prefill's TTFT from when that instance got the prompt, so time spent waiting for the decode side's
KV reservation is not counted as prefill pressure; the decode side shows it as waiting requests)
and asks the policy. A flip drains the instance: it leaves both routing pools at once (``flipping``; its
``RoleLoad`` keeps the old role with ``flipping=True``) and takes the new role when it holds none
of the old role's work:

- decode → prefill: its decode requests leave at its next step boundary, each to the decode
  instance the routing policy picks among the others, by migration (the KV the destination lacks
  copied at ``kv_bandwidth`` while the request keeps decoding here, then it continues there) or by
  recompute (prompt and output so far prefilled again there), as ``xllm.sched.move_cost`` prices
  them with the destination's queued prefill and measured speed — the rule of the gateway's
  ``Mover`` (``drain_moves``: ``auto``; or always one way; ``off``: they finish here). Reservations
  it already made are installed and then moved.
- prefill → decode: the prompts it has queued or running are finished and handed off as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from xllm.sched import move_cost
from xllm.sched.elastic import RoleLoad
from xllm.sched.registry import PD_POLICIES
from xllm.sim.events import MOVE_DONE, PD_TICK
from xllm.sim.instance import DECODE, MIXED, PREFILL, SimInstance, SimSeq

if TYPE_CHECKING:
    from xllm.sim.cluster import Cluster, PDRequest


@dataclass
class Move:
    """A migration under way: ``seq`` keeps decoding on ``source`` until its KV reached ``dest``."""

    seq: SimSeq
    source: SimInstance
    dest: SimInstance


class RoleManager:
    """The gateway's role-flip loop over a simulated cluster."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        cfg = cluster.cfg
        # every PD policy takes the dynamic one's arguments (static ignores them)
        self.policy = PD_POLICIES.create(
            cfg.pd_policy, cfg.slo_ttft_s, cfg.slo_tpot_s, predictor=cluster.model,
            token_budget=cfg.max_num_batched_tokens, window_s=cfg.pd_window_s, cooldown_s=cfg.pd_cooldown_s,
            cluster_cooldown_s=cfg.pd_cluster_cooldown_s, max_in_progress=cfg.pd_max_in_progress,
            max_flips_per_decision=cfg.pd_max_flips)
        self.static = cfg.pd_policy == "static"
        self.log: list[dict] = []
        self.bytes_under_way = 0
        self.migrating: dict[int, Move] = {}        # id(seq) -> its migration under way
        self.landing: dict[int, list[Move]] = {}    # source index -> copied migrations to land at its boundary

    def start(self) -> None:
        if not self.static:
            self.cluster.q.at(self.cluster.cfg.pd_interval_s, PD_TICK)

    # ---- deciding ------------------------------------------------------------------------------------------
    def loads(self) -> list[RoleLoad]:
        gw = self.cluster.gateway
        out = []
        for view in gw.views:
            inst = view.inst
            if inst.role not in (PREFILL, DECODE):
                continue
            report = gw.snapshot_report(view)
            running, waiting, _, _, pending, tps, ttft, tpot = report[:8]
            context = report[12] if inst.role == DECODE else 0
            # the prefill queue the instance reports: the gateway's own pending-prefill accounting also
            # counts prompts still waiting for their decode instance's KV reservation, a decode-side
            # shortage that must not read as TTFT pressure on the prefill side
            out.append(RoleLoad(inst.instance_id, inst.role, running, waiting, pending, ttft, tpot,
                                inst.flipping is not None, tps, context,
                                recent_prompt_tokens=view.prompts.mean(self.cluster.q.now)))
        return out

    def tick(self) -> None:
        c = self.cluster
        for flip in self.policy.decide(c.q.now, self.loads()):
            self.flip(flip.instance_id, flip.to_role, flip.reason, flip.trigger)
        c.q.at(c.q.now + c.cfg.pd_interval_s, PD_TICK)

    def flip(self, instance_id: str, to_role: str, reason: str, trigger: str = "") -> None:
        c = self.cluster
        inst = next(i for i in c.instances if i.instance_id == instance_id)
        if inst.role == to_role or inst.flipping is not None:
            return
        self.log.append({"time": c.q.now, "instance": instance_id, "from": inst.role, "to": to_role,
                         "trigger": trigger, "reason": reason})
        if c.timeline is not None:
            c.timeline.event(c.q.now, "role_flip_started", instance=instance_id, from_role=inst.role, to_role=to_role,
                             trigger=trigger, reason=reason)
        inst.stats.role_flips += 1
        inst.flipping = to_role
        c.gateway.views[inst.index].snap = None
        if not inst.busy:
            self.step_boundary(inst)
            c.kick(inst)

    # ---- draining ---------------------------------------------------------------------------------------
    def step_boundary(self, inst: SimInstance) -> None:
        """Between two steps of flipping ``inst``: move its decode work off (or wait for it), finish
        the flip when nothing of the old role is left."""
        for move in self.landing.pop(inst.index, []):
            self._land(move)
        if inst.role == DECODE and self.cluster.cfg.drain_moves != "off":
            for seq in [s for s in inst.running if s.phase != PREFILL and s.num_tokens - s.num_computed_tokens == 1
                        and id(s) not in self.migrating]:  # decoding ones (a prefill finishes first)
                self._move(seq, inst)
        if not self._old_work(inst):
            old = inst.role
            inst.role, inst.flipping = inst.flipping, None
            self.cluster.gateway.views[inst.index].snap = None
            if (timeline := self.cluster.timeline) is not None:
                timeline.event(self.cluster.q.now, "role_flip_finished", instance=inst.instance_id, from_role=old,
                               to_role=inst.role, outcome="done")

    def _old_work(self, inst: SimInstance) -> bool:
        if inst.role == DECODE:
            return bool(inst.running or inst.awaiting or inst.reserving
                        or any(s.phase != PREFILL for s in inst.waiting))
        return bool(inst.handing_off or any(s.phase == PREFILL for s in (*inst.running, *inst.waiting)))

    def installed(self, pdr: PDRequest) -> None:
        """A hand-off landed on a decode instance (which may be flipping away)."""
        d = pdr.d_view.inst
        if d.flipping is not None and not d.busy:
            self.step_boundary(d)

    def _move(self, seq: SimSeq, source: SimInstance) -> None:
        c = self.cluster
        gw = c.gateway
        decodes = [v for v in gw.pools()[1] if v.inst is not source]
        if not decodes:
            return  # nowhere to go: it finishes here
        view, matched = gw.route(seq.req, decodes)
        dest = view.inst
        snap = gw.snapshot(view)
        cfg = c.cfg
        speed = snap.prefill_tokens_per_s or source.prefill_tps or max(i.prefill_tps for i in c.instances) or 0.0
        tokens = seq.num_computed_tokens
        cost = move_cost(tokens * cfg.kv_bytes_per_token, tokens, matched, cfg.kv_bandwidth,
                         snap.pending_prefill_tokens, speed, self.bytes_under_way)
        migrate = {"migrate": True, "recompute": False}.get(cfg.drain_moves, cost.migrate)
        seq.req.moves += 1
        if c.timeline is not None:
            c.timeline.event(c.q.now, "move_started", request_id=str(seq.rid), source=source.instance_id,
                             destination=dest.instance_id, how="migrate" if migrate else "recompute", tokens=tokens,
                             kv_bytes=cost.bytes_to_send if migrate else 0)
        if migrate:
            self.bytes_under_way += cost.bytes_to_send
            seq.req.transfer_bytes += cost.bytes_to_send
            move = self.migrating[id(seq)] = Move(seq, source, dest)
            c.q.at(c.transfer_seconds(dest.index, cost.bytes_to_send), MOVE_DONE, (move, cost.bytes_to_send))
            return
        self._rehome(seq, source, dest, migrated=False)

    def move_done(self, payload: tuple[Move, int]) -> None:
        """A migration's KV reached its destination: the request continues there from the source's
        next step boundary."""
        move, nbytes = payload
        self.bytes_under_way = max(self.bytes_under_way - nbytes, 0)
        if move.source.busy:
            self.landing.setdefault(move.source.index, []).append(move)
            return
        self._land(move)
        if move.source.flipping is not None:
            self.step_boundary(move.source)
        self.cluster.kick(move.source)

    def _land(self, move: Move) -> None:
        del self.migrating[id(move.seq)]
        landed = move.seq.req.finish is None and any(s is move.seq for s in move.source.running)
        if landed:
            self._rehome(move.seq, move.source, move.dest, migrated=True)  # else finished or preempted meanwhile
        elif (timeline := self.cluster.timeline) is not None:
            timeline.event(self.cluster.q.now, "move_finished", request_id=str(move.seq.rid),
                           source=move.source.instance_id, destination=move.dest.instance_id, how="migrate",
                           outcome="cancelled")

    def _rehome(self, seq: SimSeq, source: SimInstance, dest: SimInstance, migrated: bool) -> None:
        """Take ``seq`` off ``source`` and continue it on ``dest``: with its KV (``migrated``; falls
        back to recompute when ``dest`` has no room) or recomputed from prompt + output so far."""
        c = self.cluster
        gw = c.gateway
        source.remove(seq)
        req = seq.req
        gw.finished(gw.views[source.index], req)
        new = SimSeq(req, MIXED, generated=seq.generated)
        new.phase = DECODE if migrated else MIXED
        if migrated and dest.kv.admit(new, new.num_tokens, dest.max_model_len) > 0:
            new.num_computed_tokens = new.num_tokens - 1
            dest.kv.on_computed(new)
            dest.running.append(new)
        else:
            new.phase = MIXED
            dest.add(new)
        req.decode_instance = dest.instance_id
        gw.dispatched(gw.views[dest.index], req, 0, prefill=False)
        if c.timeline is not None:
            c.timeline.event(c.q.now, "move_finished", request_id=str(seq.rid), source=source.instance_id,
                             destination=dest.instance_id, how="migrate" if migrated else "recompute",
                             outcome="done" if new.phase == DECODE else "recomputed")
        c.kick(dest)
