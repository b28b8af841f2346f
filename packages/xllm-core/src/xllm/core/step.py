"""One engine step between scheduling and emitting: its inputs, forward and samples."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from xllm.core.model_runner import BatchInputs, ModelRunner
from xllm.core.sampler import Sampler, SampleResult
from xllm.core.sequence import PLACEHOLDER, Sequence
from xllm.sched import StepPlan


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

    def _run(self) -> SampleResult | None:
        logits = self.runner.execute(self.batch, self.on_layer)
        return self.sampler(logits, self.batch.sample_seqs) if self.batch.sample_seqs else None

    def start(self, executor: Executor | None) -> None:
        """Run the forward now (``executor`` None) or on the executor's thread."""
        if executor is None:
            self.result = self._run()
        else:
            self._future = executor.submit(self._run)

    def wait(self) -> SampleResult | None:
        if self._future is not None:
            self.result = self._future.result()
            self._future = None
        return self.result
