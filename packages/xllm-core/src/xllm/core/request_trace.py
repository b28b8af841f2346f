"""What the engine records of a traced request: its prefill chunks, decode and speculation, step by step.

The engine service (:mod:`xllm.engine.tracing`) makes a :class:`RequestTrace` for a request whose caller
sent a sampled trace context and hands it to :meth:`AsyncEngine.submit <xllm.core.AsyncEngine.submit>`; the
engine thread fills it after each step the request ran in (:func:`record_step`, called only while some
traced request is live, so untraced serving pays nothing); the service reads it once the request's final
chunk reached it (that chunk's delivery to the event loop orders the reads after the writes) and turns it
into spans. Times are wall-clock seconds (``time.time()``), as spans need them. Torch-free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xllm.core.step import StepInFlight


@dataclass
class ChunkRecord:
    """One prefill chunk of the request: when its step's forward ran, and how many prompt tokens it computed."""

    start: float
    end: float
    tokens: int
    recompute: bool = False  # after a preemption (or a resume's replay): tokens computed again


@dataclass
class RequestTrace:
    """One traced request as the engine ran it (see the module docstring)."""

    arrival: float = field(default_factory=time.time)
    chunks: list[ChunkRecord] = field(default_factory=list)
    first_scheduled: float | None = None
    sampled: bool = False          # a token was sampled (the prompt is done): later 1-token chunks decode
    decode_start: float | None = None
    decode_end: float | None = None
    decode_steps: int = 0
    spec_steps: int = 0            # decode steps that verified drafts
    spec_drafted: int = 0
    spec_accepted: int = 0
    preemptions: int = 0
    cached_prompt_tokens: int = 0

    @property
    def prefill_tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)


def record_step(flight: StepInFlight, perf_now: float, wall_now: float) -> None:
    """Add the landed step ``flight`` to the record of each traced sequence in it (``perf_now`` and
    ``wall_now``: the same instant on ``time.perf_counter`` and ``time.time``)."""
    start = wall_now - (perf_now - flight.started)
    end = start + flight.forward_seconds if flight.forward_seconds > 0 else wall_now
    sampled = None
    verified = {v.seq: v for v in flight.verified}
    for seq, n in flight.chunks:
        rec = seq.trace
        if rec is None:
            continue
        if sampled is None:
            sampled = set(flight.batch.sample_seqs)
        if rec.first_scheduled is None:
            rec.first_scheduled = start
        rec.preemptions, rec.cached_prompt_tokens = seq.num_preemptions, seq.num_cached_prompt_tokens
        v = verified.get(seq)
        if seq not in flight.spec_starts and (n > 1 or not rec.sampled):
            rec.chunks.append(ChunkRecord(start, end, n, recompute=rec.sampled))
        else:
            if rec.decode_start is None:
                rec.decode_start = start
            rec.decode_end = end
            rec.decode_steps += 1
            if v is not None:
                rec.spec_steps += 1
                rec.spec_drafted += v.num_drafts
                rec.spec_accepted += v.num_accepted
        if seq in sampled:
            rec.sampled = True
