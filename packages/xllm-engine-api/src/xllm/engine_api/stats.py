"""What the engine reports about itself, per step and cumulatively."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    finish_reason: str  # "stop", "length", "abort", "error"
    prompt_tokens: int
    completion_tokens: int
    e2e_latency: float
    ttft: float | None


@dataclass
class OfflineStepStats:
    """Offline (``service_tier: flex``) work of one step (:mod:`xllm.sched.colocation`)."""

    prompt_tokens: int = 0       # offline prompts whose first token came out this step
    generation_tokens: int = 0
    finished: int = 0            # offline requests that ended (any reason)
    # offline sequences preempted by reason: "kv" (memory), "batch_full" (a slot for an online request),
    # "slo" (held out of the step for online work, KV kept: an interruption at a chunk boundary)
    preempted: dict[str, int] = field(default_factory=dict)
    longest_wait: float = 0.0    # the longest an offline sequence in the queues has gone without a chunk, s


@dataclass
class ExpertBalance:
    """One closed window of an expert-parallel instance's MoE load (:mod:`xllm.core.eplb`): ``imbalance``, the
    max / mean of the tokens each rank's experts computed (mean over the MoE layers; 1.0 is even), ``tokens``
    routed to each logical expert (summed over the layers; ``layer_tokens``: per MoE layer), whether a placement
    switch starts (``switching``) and the switches completed before it (``rebalances``)."""

    imbalance: float
    tokens: list[int]
    switching: bool = False
    rebalances: int = 0
    layer_tokens: list[list[int]] = field(default_factory=list)


@dataclass
class StepStats:
    """One engine step, handed to observers after the step completes."""

    num_running: int
    num_waiting: int
    batch_size: int              # sequences in the forward
    num_decode_tokens: int
    num_prefill_tokens: int
    num_preempted: int
    kv_usage: float
    step_time: float
    prompt_tokens: int = 0       # prompts whose first token came out this step
    ttfts: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # |predicted - measured| / measured of the step-time predictor's prediction for this step
    # (xllm.core.step_timing; None: no prediction yet)
    step_time_prediction_error: float | None = None
    offline: OfflineStepStats = field(default_factory=OfflineStepStats)
    # speculative decoding (xllm.core.spec): sequences that verified drafts, drafts verified, drafts
    # accepted, and accepted drafts by position (index j: the (j+1)-th draft of a run)
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # beam search (xllm.core.beam): group decode steps, beam rows computed, candidates a heap scan examined,
    # searches that ended before max_tokens (early stopping / no possible improvement)
    beam_steps: int = 0
    beam_rows: int = 0
    beam_candidates_scanned: int = 0
    beam_early_terminations: int = 0
    # expert parallelism (xllm.core.eplb): set on the step that closed a load window
    experts: ExpertBalance | None = None
    # multimodal (xllm.core.images), since the last step: images the vision tower encoded (in the encode phase
    # or a prefill chunk), images found in the encoder cache, the tower's seconds
    images_encoded: int = 0
    image_cache_hits: int = 0
    image_encode_seconds: float = 0.0


class StatsObserver(Protocol):
    """Receives every step's stats (called on the engine thread; must be quick)."""

    def on_step(self, stats: StepStats) -> None: ...


@dataclass
class EngineCounters:
    """Cumulative totals since the engine started."""

    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0
    num_preemptions: int = 0
    max_batch_size: int = 0
    multi_seq_decode_steps: int = 0  # decode steps that ran more than one sequence
    recent_ttft: float = 0.0         # exponential moving averages (seconds)
    recent_tpot: float = 0.0
    offline_requests: int = 0        # offline (flex) requests finished, their tokens, their preemptions
    offline_prompt_tokens: int = 0
    offline_generation_tokens: int = 0
    offline_preemptions: dict[str, int] = field(default_factory=dict)
    offline_longest_wait: float = 0.0  # as of the last step (seconds)

    def observe_offline(self, s: OfflineStepStats) -> None:
        self.offline_requests += s.finished
        self.offline_prompt_tokens += s.prompt_tokens
        self.offline_generation_tokens += s.generation_tokens
        for reason, n in s.preempted.items():
            self.offline_preemptions[reason] = self.offline_preemptions.get(reason, 0) + n

    def observe_latency(self, ttfts: list[float], itls: list[float], alpha: float = 0.1) -> None:
        for v in ttfts:
            self.recent_ttft = v if self.recent_ttft == 0.0 else (1 - alpha) * self.recent_ttft + alpha * v
        for v in itls:
            self.recent_tpot = v if self.recent_tpot == 0.0 else (1 - alpha) * self.recent_tpot + alpha * v
