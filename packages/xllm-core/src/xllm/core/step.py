"""One engine step between scheduling and emitting: its inputs, forward and samples."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from xllm.core.beam import BeamPass, BeamRunner, BeamStepResult
from xllm.core.grammar import Grammars, PendingMasks
from xllm.core.model_runner import BatchInputs, ModelRunner
from xllm.core.sampler import Sampler, SampleResult
from xllm.core.sampler import prompt_logprobs as compute_prompt_logprobs
from xllm.core.sequence import PLACEHOLDER, Phase, Sequence
from xllm.core.spec.verify import Verified, verify
from xllm.sched import StepPlan
from xllm.sched.latency import StepShape


@dataclass(eq=False)
class StepInFlight:
    """A prepared step whose forward + sampling runs inline or on a worker thread.

    ``batch.input_ids`` may hold :data:`PLACEHOLDER` rows for tokens the previous
    step is still computing; :meth:`patch_placeholders` swaps the real ones in
    before :meth:`start`.
    """

    plan: StepPlan
    chunks: list[tuple[Sequence, int]]
    batch: BatchInputs
    runner: ModelRunner
    sampler: Sampler
    started: float
    result: SampleResult | None = None
    placeholder_at: list[int] = field(default_factory=list)  # output index of each sampled seq's placeholder
    on_layer: Callable[[int], None] | None = None  # hears each layer stored (prefill hand-offs streaming KV)
    shape: StepShape = field(default_factory=StepShape)  # what it computes (step_timing.step_shape)
    began: float = 0.0  # perf_counter when the engine began the step (before scheduling it)
    forward_seconds: float = 0.0  # the forward and sampling alone, wherever they ran
    grammars: Grammars | None = None  # constrained decoding: masks computed while the forward runs
    masks: PendingMasks | None = None
    # prompt logprobs computed by this step: (sequence, first position, entries), applied when it lands
    prompt_logprobs: list[tuple[Sequence, int, list]] = field(default_factory=list)
    # speculative decoding: each speculating sequence's verified run, and where its chunk began
    verified: list[Verified] = field(default_factory=list)
    spec_starts: dict[Sequence, int] = field(default_factory=dict)
    # beam requests whose prompt this step finished: their last row's logits (xllm.core.beam starts from them)
    beam_logits: dict[Sequence, torch.Tensor] = field(default_factory=dict)
    # beam groups decoding: their next step rides in this forward (taken at start, landed by _run)
    beams: BeamRunner | None = None
    beam_pass: BeamPass | None = None
    beam_starts: BeamStepResult = field(default_factory=BeamStepResult)  # the searches begun as it landed
    _future: Future | None = field(default=None, repr=False)

    @property
    def seqs(self) -> set[Sequence]:
        return {seq for seq, _ in self.chunks}

    @property
    def sampled_seqs(self) -> set[Sequence]:
        return set(self.batch.sample_seqs)

    def patch_placeholders(self) -> None:
        """Replace placeholder input tokens by the tokens that have landed since."""
        ids = self.batch.input_ids
        rows = (ids == PLACEHOLDER).nonzero().flatten().tolist()
        for row in rows:
            seq = self._seq_of_row(row)
            token = seq.token_slice(int(self.batch.positions[row]), int(self.batch.positions[row]) + 1)[0]
            if token == PLACEHOLDER:
                raise RuntimeError(f"{seq.request_id}: input token at {int(self.batch.positions[row])} not landed")
            ids[row] = token

    def _seq_of_row(self, row: int) -> Sequence:
        start = 0
        for seq, n in self.chunks:
            if row < start + n:
                return seq
            start += n
        raise IndexError(row)

    def _plain_greedy(self) -> bool:
        """Whether the step needs its sampled rows' argmax alone (no beams, verification, prompt logprobs,
        grammar masks; every sampled sequence :meth:`Sampler.plain_greedy`)."""
        b = self.batch
        return (self.beam_pass is None and self.masks is None and not b.spec_spans and not b.prompt_rows
                and self.sampler.plain_greedy(b.sample_seqs))

    def _run(self) -> SampleResult | None:
        t0 = time.perf_counter()
        if self._plain_greedy():  # the model's greedy head: no logits written, no sampler pass
            result = self.sampler.greedy_result(self.runner.execute(self.batch, self.on_layer, greedy=True))
            self.forward_seconds = time.perf_counter() - t0
            return result
        beams = self.beam_pass
        logits = self.runner.execute(self.batch, self.on_layer, beams.first if beams is not None else None)
        if beams is not None:  # the beam rows' logits follow the batch's
            mine = len(logits) - beams.first.num_rows
            beams.land(logits[mine:])
            logits = logits[:mine]
        num_sampled = len(self.batch.sample_seqs)
        num_scored = num_sampled + len(self.batch.prompt_rows)
        if self.batch.spec_spans:
            self.verified = verify(self.sampler, logits[num_scored:], self.batch.spec_spans)
        if self.batch.prompt_rows:
            self.prompt_logprobs = compute_prompt_logprobs(logits[num_sampled:num_scored], self.batch.prompt_spans)
        if len(logits) > num_sampled:
            logits = logits[:num_sampled]
        for i, seq in enumerate(self.batch.sample_seqs):
            if seq.params.beam_width is not None and seq.phase is not Phase.PREFILL:  # (a prefill side hands off)
                self.beam_logits[seq] = logits[i].float().clone()
        result = self.sampler(logits, self.batch.sample_seqs, self.masks) if self.batch.sample_seqs else None
        self.forward_seconds = time.perf_counter() - t0
        return result

    def start(self, executor: Executor | None) -> None:
        """Run the forward now (``executor`` None) or on the executor's thread. Call it once the
        previous step's tokens have landed: the constrained sequences' masks start from them here,
        on the grammar thread, and are ready when the forward ends. The beam groups' next step joins
        the forward here, where their state is current."""
        if self.beams is not None:
            self.beam_pass = self.beams.begin()
        if self.grammars is not None and self.batch.sample_seqs:
            self.masks = self.grammars.begin(self.batch.sample_seqs)
        if executor is None:
            self.result = self._run()
        else:
            self._future = executor.submit(self._run)

    def wait(self) -> SampleResult | None:
        if self._future is not None:
            self.result = self._future.result()
            self._future = None
        return self.result
