"""The engine's side of beam search (xllm.core.beam): a beam request's prompt done, its group's
steps alone or riding in the engine step's forward, and its end.

:class:`EngineBeams` is a part of :class:`xllm.core.engine.LLMEngine` (its base class), kept in its
own module; it works on the engine's state, which the engine owns and creates. Engine thread only.

Lifecycle of a beam request (see docs/architecture.md):

- its prompt runs as any prompt (prefix cache, chunked prefill); the step that computes its last
  chunk keeps that row's logits (``StepInFlight.beam_logits``) and :meth:`_beam_prompt_done` starts
  its group (``BeamRunner.start``: the first tokens chosen, the sequence parked with its prompt KV);
- on the prefill side of a prefill/decode hand-off the logits are not kept: the prompt's KV is
  handed off with an empty chunk (no token: the decode side runs the search), and the decode side
  installs the KV of all but the last prompt token (``EngineMoves.install_kv``), which it computes
  again for the logits its group starts from;
- every later engine step decodes one token per beam of every live group: in the step's own
  forward when the step has other work (``StepInFlight.beam_pass``, landed with it), else in
  forwards of their own (:meth:`_beam_step`);
- a group whose search ended retires with its request's final chunk (:meth:`_beams_done`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from xllm.core.beam import BeamRunner, BeamStepResult
from xllm.core.sequence import Phase, Sequence
from xllm.engine_api.stats import FinishedRequest, StatsObserver, StepStats
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.enums import finish_reason_name

if TYPE_CHECKING:
    from xllm.core.kv.base import KVCacheBackend
    from xllm.core.output_processor import RequestOutput
    from xllm.core.scheduler import Scheduler
    from xllm.core.step import StepInFlight
    from xllm.engine_api.stats import EngineCounters


class EngineBeams:
    """Beam groups in :class:`~xllm.core.engine.LLMEngine` (see the module docstring)."""

    # the engine's state these methods use (created by LLMEngine.__init__)
    beams: BeamRunner
    scheduler: Scheduler
    kv: KVCacheBackend
    counters: EngineCounters
    requests: dict[str, RequestOutput]
    observers: list[StatsObserver]
    _stepping: list[Sequence]
    _hand_off: Callable[[RequestOutput, int, float], None]  # EngineMoves
    _notify: Callable[[StepStats], None]  # LLMEngine

    def _beam_prompt_done(self, seq: Sequence, out: RequestOutput, flight: StepInFlight, row: int, now: float,
                          ttfts: list[float], finished: list[FinishedRequest]
                          ) -> tuple[list[engine_pb2.GenerateResponse], int]:
        """A beam request's prompt was computed by ``flight`` (``row``: its sampled row): start its
        group, or hand its KV off (prefill side). Returns chunks and the prompt tokens to count."""
        seq.first_token_time = seq.last_token_time = now
        if seq.phase is Phase.PREFILL:  # the decode side runs the search: no token goes out from here
            ttfts.append(now - seq.arrival_time)
            self._hand_off(out, flight.result.token_ids[row], now)
            return [engine_pb2.GenerateResponse(request_id=seq.request_id)], seq.num_prompt_tokens
        counted = 0
        if seq.phase is Phase.MIXED:  # (a decode side's prompt and first token were the prefill side's)
            ttfts.append(now - seq.arrival_time)
            counted = seq.num_prompt_tokens
        self.scheduler.park_for_beams(seq)
        started = self.beams.start(seq, flight.beam_logits[seq])
        flight.beam_starts.add_counts(started)  # (a search its first selection ended early)
        return self._beams_done(started, finished, now), counted

    def _beam_step(self) -> list[engine_pb2.GenerateResponse]:
        """One decode step of every beam group in forwards of their own: a step with no other work
        (any step before it has landed); finished searches' final chunks."""
        began = time.perf_counter()
        self._stepping = [g.seq for g in self.beams.groups]  # the suspects if the beam forward raises
        result = self.beams.step()
        self._stepping = []
        finished: list[FinishedRequest] = []
        responses = self._beams_done(result, finished, time.time())
        c = self.counters
        c.steps += 1
        c.finished_requests += len(finished)
        if self.observers:
            self._notify(StepStats(
                num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                batch_size=len(self.beams.groups) + len(finished), num_decode_tokens=result.rows,
                num_prefill_tokens=0, num_preempted=0, kv_usage=self.kv.usage,
                step_time=time.perf_counter() - began, finished=finished, **beam_stats(result)))
        return responses

    def _beams_done(self, result: BeamStepResult, finished: list[FinishedRequest], now: float
                    ) -> list[engine_pb2.GenerateResponse]:
        """Retire a landed beam step (or start): the searches that ended lose their requests and
        prompt KV, and give their final chunks (none for a request aborted while its step ran)."""
        chunks = []
        for seq, chunk in self.beams.retire(result):
            out = self.requests.get(seq.request_id)
            if out is None or out.seq is not seq:
                continue
            del self.requests[seq.request_id]
            self.scheduler.finish(seq)
            finished.append(FinishedRequest(seq.request_id, finish_reason_name(chunk.finish_reason),
                                            seq.num_prompt_tokens, chunk.usage.completion_tokens,
                                            now - seq.arrival_time, seq.first_token_time - seq.arrival_time))
            chunks.append(chunk)
        return chunks


def beam_stats(*results: BeamStepResult | None) -> dict:
    """A step's beam work (its groups' steps, the searches it began) as :class:`StepStats` fields."""
    done = [r for r in results if r is not None]
    return dict(beam_steps=sum(r.steps for r in done), beam_rows=sum(r.rows for r in done),
                beam_candidates_scanned=sum(r.scanned for r in done),
                beam_early_terminations=sum(r.early_terminations for r in done))


def install_beam_kv(seq: Sequence, received: bool) -> None:
    """Decode side of a beam request's hand-off: the KV of all but the last prompt token counts as
    computed (``received``); that token is computed here for the logits the search starts from (the
    prefill side's sampled token is not a beam's)."""
    if received:
        seq.num_computed_tokens = seq.num_prompt_tokens
    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens - 1)

