"""The simulated cluster: a gateway and N engine instances on one event queue.

A request arrives (from the trace), waits ``gateway_overhead_s``, and is placed by the gateway
(:mod:`xllm.sim.gateway`: the real routing policy, or ``PDPlacement`` when both roles have
instances). Mixed: it queues on its instance and runs there. PD, as the live system does it: the
decode instance reserves KV for the whole prompt first (reusing its own cached prefix; between its
steps, as the engine loop does), then the prefill instance computes the prompt and samples token 1
(the TTFT), keeps the KV while the blocks the decode side lacks travel
(``(prompt − decode-side cached) × kv_bytes_per_token / kv_bandwidth``, queued per receiving
instance), and releases it; the decode instance installs it and decodes the rest. With
``pd_overflow`` and a TTFT objective, ``PDPlacement`` may put a request whole on a decode instance
instead (every prefill instance predicted to miss the objective): it queues there as a mixed
request and runs there.

Every instance steps as the engine does: when idle and given work it plans a step with its batch
policy, the step lasts what the step-time model predicts (times a random factor of mean 1 with
``step_noise``: measured steps scatter around any model, and queueing tails grow with that
scatter, while the policies still see the prediction), and at its end the next one is planned.
Role flips (``pd_policy``) and the moves a flip causes live in :mod:`xllm.sim.roles`. EPD
(``epd_strategy`` ``e+p+d`` / ``ed+p``): a request with images first goes to the encode or decode instance with
the fewest encode jobs queued (the gateway's :class:`~xllm.gateway.encode.EncodeStage` picks the fewest in
flight), which encodes them with its next step; ``embedding_transfer_s`` later it is placed as a PD request
whose prefill encodes nothing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from functools import partial

from xllm.sched import BATCH_POLICIES, EPD_STRATEGIES, ROUTING_POLICIES, BatchPolicy, BatchSettings, PDPlacement
from xllm.sched.latency import StepShape, StepTimeModel
from xllm.sim.config import SimConfig
from xllm.sim.events import DISPATCH, HEARTBEAT, MOVE_DONE, PD_TICK, STEP_END, TIMELINE, TRANSFER_DONE, EventQueue
from xllm.sim.gateway import Gateway, InstanceView
from xllm.sim.instance import DECODE, ENCODE, MIXED, PREFILL, SimInstance, SimSeq
from xllm.sim.kvcache import SimKV
from xllm.sim.metrics import InstanceReport, Request, report
from xllm.sim.timeline import Timeline
from xllm.sim.trace import RequestSpec

Progress = Callable[[int, int, float], None]  # (finished requests, arrived requests, simulated seconds)


class PDRequest:
    """The two halves of one PD request; ``sent``: when the prefill instance got the prompt (after
    the decode side's KV reservation)."""

    __slots__ = ("d_view", "dseq", "p_view", "pseq", "sent")

    def __init__(self, p_view: InstanceView, d_view: InstanceView, dseq: SimSeq) -> None:
        self.p_view, self.d_view, self.dseq = p_view, d_view, dseq
        self.pseq: SimSeq | None = None
        self.sent = 0.0


def make_batch_policy(name: str, cfg: SimConfig, predict: Callable[[StepShape], float | None],
                      clock: Callable[[], float]) -> BatchPolicy:
    """``BATCH_POLICIES[name]`` built from the engine's settings (:class:`~xllm.sched.BatchSettings`),
    the step-time predictor and the simulated clock, as an engine builds its own."""
    return BATCH_POLICIES.get(name).from_settings(BatchSettings(
        cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.chunked_prefill, slo_tpot_s=cfg.slo_tpot_s,
        offline_slo_fraction=cfg.offline_slo_fraction, predict=predict, starvation_s=cfg.offline_starvation_s,
        clock=clock, max_encode_images=cfg.max_encode_images))


def noisy(step: Callable[[StepShape], float], sigma: float, seed: str = "step-noise") -> Callable[[StepShape], float]:
    """``step`` times a lognormal factor of mean 1 and log-deviation ``sigma``, one draw per step from
    a seeded generator (a run stays deterministic): what an instance takes, while its policies predict
    ``step``."""
    rng = random.Random(seed)
    mu = -sigma * sigma / 2

    def actual(shape: StepShape) -> float:
        return step(shape) * math.exp(rng.gauss(mu, sigma))
    return actual


class Cluster:
    """Instances, gateway, clock; :meth:`run` simulates a trace and :meth:`report` sums it up."""

    def __init__(self, cfg: SimConfig, model: StepTimeModel) -> None:
        cfg.check()
        self.cfg = cfg
        self.model = model
        self.q = EventQueue()
        clock = self.clock
        speed = cfg.speed
        reported = model if speed == 1 else StepTimeModel(tuple(c / speed for c in model.coefficients))
        step = reported.step_seconds
        actual = step if cfg.step_noise <= 0 else noisy(step, cfg.step_noise)
        roles = [PREFILL] * cfg.prefill_instances + [DECODE] * cfg.decode_instances \
            + [ENCODE] * cfg.encode_instances if cfg.pd else [MIXED] * cfg.instances
        self.epd = EPD_STRATEGIES.get(cfg.epd_strategy)
        self.instances: list[SimInstance] = []
        for i, role in enumerate(roles):
            kv = SimKV(cfg.kv_blocks, cfg.block_size, cfg.prefix_cache, listener=partial(self._kv_event, i))
            policy = make_batch_policy(cfg.batch_policy, cfg, step, clock)
            self.instances.append(SimInstance(f"e{i}", i, role, kv, policy, actual, cfg.max_num_seqs,
                                              cfg.max_model_len, reported, cfg.max_num_batched_tokens,
                                              cfg.encode_image_s / speed, cfg.max_encode_images > 0))
        placement = PDPlacement(ROUTING_POLICIES.create(cfg.routing),
                                slo_ttft_s=cfg.slo_ttft_s if cfg.pd_overflow else None, predictor=model,
                                token_budget=cfg.max_num_batched_tokens)
        self.gateway = Gateway(self.instances, ROUTING_POLICIES.create(cfg.routing), placement, cfg.heartbeat_s)
        self.requests: list[Request] = []
        self.pd: dict[int, PDRequest] = {}
        self.outstanding = 0
        self.link_free = [0.0] * len(self.instances)
        from xllm.sim.roles import RoleManager  # roles imports this module's types
        self.roles = RoleManager(self) if cfg.pd else None
        self.timeline: Timeline | None = None  # record_timeline()

    def log_steps(self) -> list[tuple]:
        """Record every step from now on: ``(start, end, instance id, ((rid, tokens), ...))`` in the
        order steps start (one list shared by the instances)."""
        log: list[tuple] = []
        for inst in self.instances:
            inst.step_log = log
        return log

    def record_timeline(self, interval_s: float) -> Timeline:
        """Record a :class:`~xllm.sim.timeline.Timeline` of the run (a frame every ``interval_s`` simulated
        seconds, flips and moves as they happen); call before :meth:`run`."""
        self.timeline = Timeline(self.instances, interval_s)
        return self.timeline

    def clock(self) -> float:
        return self.q.now

    def _kv_event(self, index: int, stored: bool, block_hash: int) -> None:
        self.gateway.kv_event(index, stored, block_hash)

    # ---- the loop -----------------------------------------------------------------------------------------
    def run(self, specs: Iterable[RequestSpec], progress: Progress | None = None, progress_every: int = 1000) -> None:
        """Simulate ``specs`` (sorted by arrival) until every request finished."""
        q = self.q
        heap = q.heap
        it = iter(specs)
        nxt = next(it, None)
        arrived = 0
        next_report = progress_every
        if self.cfg.heartbeat_s > 0:
            n = len(self.instances)
            for i in range(n):
                q.at((i + 1) * self.cfg.heartbeat_s / n, HEARTBEAT, i)
        if self.roles is not None:
            self.roles.start()
        if self.timeline is not None:
            self.timeline.sample(q.now)
            q.at(q.now + self.timeline.interval_s, TIMELINE)
        handlers = {STEP_END: self._step_end, DISPATCH: self._dispatch, TRANSFER_DONE: self._transfer_done,
                    HEARTBEAT: self._heartbeat, PD_TICK: self._pd_tick, MOVE_DONE: self._move_done,
                    TIMELINE: self._timeline_tick}
        while nxt is not None or self.outstanding:
            if heap and (nxt is None or heap[0][0] <= nxt.arrival):
                _, kind, payload = q.pop()
                handlers[kind](payload)
            elif nxt is not None:
                q.now = nxt.arrival
                self._arrive(nxt)
                arrived += 1
                nxt = next(it, None)
            else:  # pragma: no cover (outstanding work always has an event queued)
                raise RuntimeError(f"{self.outstanding} requests outstanding and nothing scheduled")
            if progress is not None and arrived - self.outstanding >= next_report:
                progress(arrived - self.outstanding, arrived, q.now)
                next_report += progress_every
        if progress is not None:
            progress(arrived - self.outstanding, arrived, q.now)
        if self.timeline is not None:
            self.timeline.sample(q.now)  # the end of the run

    def _arrive(self, spec: RequestSpec) -> None:
        req = Request(spec, self.cfg.block_size, self.cfg.offline_priority if spec.offline else 0)
        self.requests.append(req)
        self.outstanding += 1
        if self.cfg.gateway_overhead_s > 0:
            self.q.at(self.q.now + self.cfg.gateway_overhead_s, DISPATCH, req)
        else:
            self._dispatch(req)

    def _heartbeat(self, index: int) -> None:
        self.gateway.heartbeat(index)
        self.q.at(self.q.now + self.cfg.heartbeat_s, HEARTBEAT, index)

    def _pd_tick(self, _payload: object) -> None:
        assert self.roles is not None
        self.roles.tick()

    def _timeline_tick(self, _payload: object) -> None:
        assert self.timeline is not None
        self.timeline.sample(self.q.now)
        self.q.at(self.q.now + self.timeline.interval_s, TIMELINE)

    def _move_done(self, move: object) -> None:
        assert self.roles is not None
        self.roles.move_done(move)

    # ---- placement ----------------------------------------------------------------------------------------
    def _dispatch(self, req: Request) -> None:
        gw = self.gateway
        gw.now = self.q.now
        if req.spec.images and not req.encoded and self._encode_elsewhere(req):
            return
        if self.cfg.pd:
            prefills, decodes = gw.pools()
            if prefills and decodes:
                self._dispatch_pd(req, prefills, decodes)
                return
        view, matched = gw.route(req, [v for v in gw.views if v.inst.role != ENCODE])
        req.instance = view.inst.instance_id
        req.matched_tokens = matched
        gw.dispatched(view, req, matched)
        view.inst.add(SimSeq(req))
        self.kick(view.inst)

    def _encode_elsewhere(self, req: Request) -> bool:
        """EPD: queue ``req``'s images on the instance of the strategy's encode role with the fewest jobs; False
        when the strategy has none, or none of the role is live (the prefill instance encodes them)."""
        role = self.epd.encode_role
        encoders = [v.inst for v in self.gateway.views if v.inst.role == role and v.inst.flipping is None]
        if role is None or not encoders:
            return False
        inst = min(encoders, key=lambda i: (len(i.encode_jobs), i.index))
        inst.add_encode_job(req)
        self.kick(inst)
        return True

    def _dispatch_pd(self, req: Request, prefills: list[InstanceView], decodes: list[InstanceView]) -> None:
        gw = self.gateway
        p_view, matched, d_view = gw.route_pd(req, prefills, decodes)
        if p_view is d_view:  # prefill overflow (PDPlacement): the whole request on a decode instance
            req.instance = req.decode_instance = d_view.inst.instance_id
            req.matched_tokens = matched
            gw.dispatched(d_view, req, matched)
            d_view.inst.add(SimSeq(req))
            self.kick(d_view.inst)
            return
        req.instance, req.decode_instance = p_view.inst.instance_id, d_view.inst.instance_id
        req.matched_tokens = matched
        gw.dispatched(p_view, req, matched)
        gw.dispatched(d_view, req, 0, prefill=False)
        dseq = SimSeq(req, DECODE)
        self.pd[req.spec.rid] = PDRequest(p_view, d_view, dseq)
        d_view.inst.add(dseq)
        self.kick(d_view.inst)

    # ---- instances ---------------------------------------------------------------------------------------
    def kick(self, inst: SimInstance) -> None:
        """``inst`` got work: if it is idle, its engine loop plans a step now."""
        if not inst.busy:
            self._start(inst)

    def _start(self, inst: SimInstance) -> None:
        if inst.reserving:
            for dseq in inst.reserve():
                self._send_prefill(dseq)
        end = inst.start_step(self.q.now)
        if end is not None:
            self.q.at(end, STEP_END, inst)

    def _send_prefill(self, dseq: SimSeq) -> None:
        """The decode side reserved KV for ``dseq``'s prompt: the prefill instance computes it."""
        pdr = self.pd[dseq.rid]
        pseq = SimSeq(dseq.req, PREFILL)
        pdr.pseq, pdr.sent = pseq, self.q.now
        pdr.p_view.inst.add(pseq)
        self.kick(pdr.p_view.inst)

    def _step_end(self, inst: SimInstance) -> None:
        now = self.q.now
        res = inst.finish_step()
        gw = self.gateway
        view = gw.views[inst.index]
        for seq in res.first:
            req = seq.req
            req.first_token = now
            gw.first_token(view, req)
            # the engine measures TTFT from when it got the request: a PD prefill's from its hand-over to
            # this instance, not from the arrival (the decode side's reservation wait is not this engine's)
            inst.observe_ttft(now - (self.pd[req.spec.rid].sent if seq.phase == PREFILL else req.spec.arrival))
        for req in res.encoded:  # EPD: its embeddings go with it to the prefill placement
            req.encoded = True
            self.q.at(now + self.cfg.embedding_transfer_s, DISPATCH, req)
        for seq in res.done:
            if seq.generated < seq.output_len:  # a PD prefill at its first token: hand the KV over
                self._transfer(self.pd[seq.rid])
            else:
                self._finish(seq.req, view)
        if self.roles is not None and inst.flipping is not None:
            self.roles.step_boundary(inst)
        self._start(inst)

    def _finish(self, req: Request, view: InstanceView) -> None:
        req.finish = self.q.now
        self.outstanding -= 1
        self.gateway.finished(view, req)
        pdr = self.pd.pop(req.spec.rid, None)
        if pdr is not None and view is pdr.p_view:  # one output token: finished on the prefill side
            pdr.d_view.inst.remove(pdr.dseq)
            self.gateway.finished(pdr.d_view, req)
            self.kick(pdr.d_view.inst)

    # ---- KV hand-offs --------------------------------------------------------------------------------------
    def transfer_seconds(self, dest: int, nbytes: int) -> float:
        """When ``nbytes`` sent to instance ``dest`` now arrive (transfers to one instance queue)."""
        now = self.q.now
        start = max(now, self.link_free[dest])
        end = start + self.cfg.transfer_latency_s + nbytes / self.cfg.kv_bandwidth
        self.link_free[dest] = end
        return end

    def _transfer(self, pdr: PDRequest) -> None:
        dseq = pdr.dseq
        nbytes = max(dseq.prompt_len - dseq.num_computed_tokens, 0) * self.cfg.kv_bytes_per_token
        dseq.req.transfer_bytes += nbytes
        self.q.at(self.transfer_seconds(pdr.d_view.inst.index, nbytes), TRANSFER_DONE, pdr)

    def _transfer_done(self, pdr: PDRequest) -> None:
        assert pdr.pseq is not None
        p, d = pdr.p_view.inst, pdr.d_view.inst
        p.release_handoff(pdr.pseq)
        self.gateway.finished(pdr.p_view, pdr.dseq.req)
        d.install(pdr.dseq)
        if self.roles is not None:
            self.roles.installed(pdr)
        self.kick(d)

    # ---- results -------------------------------------------------------------------------------------------
    def report(self) -> dict:
        """The run's figures (:func:`xllm.sim.metrics.report`)."""
        start = min((r.spec.arrival for r in self.requests), default=0.0)
        end = max((r.finish for r in self.requests if r.finish is not None), default=start)
        span = max(end - start, 1e-9)
        instances = [InstanceReport(i.instance_id, i.role, min(i.stats.busy_s / span, 1.0), i.stats.steps,
                                    i.stats.prefill_tokens, i.stats.decode_tokens, i.stats.preemptions,
                                    i.stats.prefix_query_tokens, i.stats.prefix_hit_tokens, i.stats.role_flips,
                                    i.stats.encoded_images)
                     for i in self.instances]
        flips = self.roles.log if self.roles is not None else []
        return report(self.requests, instances, self.cfg.slo_ttft_s, self.cfg.slo_tpot_s, flips,
                      {"events": self.q.processed})
