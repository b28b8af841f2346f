"""The statistics of a landed step as :class:`~xllm.engine_api.stats.StepStats` reports them: co-location's
decisions, speculation's figures, the requests that finished."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xllm.engine_api.stats import FinishedRequest, OfflineStepStats

if TYPE_CHECKING:
    from xllm.core.sequence import Sequence
    from xllm.core.step import StepInFlight
    from xllm.sched import StepPlan


def offline_scheduling(plan: StepPlan, out: OfflineStepStats) -> None:
    """The co-location decisions of ``plan`` (xllm.sched.colocation) into ``out``: offline sequences
    preempted by reason (``slo``: interrupted, KV kept) and the longest offline wait."""
    for seq, reason in zip(plan.preempted, plan.preempt_reasons, strict=False):
        if seq.offline:
            out.preempted[reason] = out.preempted.get(reason, 0) + 1
    if plan.interrupted:
        out.preempted["slo"] = out.preempted.get("slo", 0) + len(plan.interrupted)
    out.longest_wait = plan.longest_offline_wait


def spec_stats(flight: StepInFlight) -> dict:
    """The step's speculation figures as :class:`StepStats` fields (none without verify runs)."""
    if not flight.verified:
        return {}
    per_pos = [0] * max(v.num_drafts for v in flight.verified)
    for v in flight.verified:
        for j in range(v.num_accepted):
            per_pos[j] += 1
    return dict(spec_num_drafts=len(flight.verified), spec_draft_tokens=sum(v.num_drafts for v in flight.verified),
                spec_accepted_tokens=sum(v.num_accepted for v in flight.verified), spec_accepted_per_pos=per_pos)


def expert_stats(runner: object) -> dict:
    """The MoE load window an expert-parallel runner closed this step, as the :class:`StepStats` field (none
    otherwise; :mod:`xllm.core.eplb`)."""
    eplb = getattr(runner, "eplb", None)
    report = eplb.take_report() if eplb is not None else None
    return {"experts": report} if report is not None else {}


def image_stats(runner: object) -> dict:
    """The images the runner's encoder cache encoded or found since the last step report, as the
    :class:`StepStats` fields (none for a text model's steps; :mod:`xllm.core.images`)."""
    cache = getattr(runner, "encoder_cache", None)
    return cache.take_report() if cache is not None else {}


def finished_request(seq: Sequence, reason: str, now: float) -> FinishedRequest:
    """``seq`` ended with ``reason`` at ``now`` (wall seconds): its request as the step reports it."""
    ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
    return FinishedRequest(seq.request_id, reason, seq.num_prompt_tokens, len(seq.output_ids),
                           now - seq.arrival_time, ttft)
