"""The engine's side of moving requests between instances (xllm.core.disagg): prefill/decode
hand-offs (reserve KV for a decode-phase request, hand a prefill-phase one's KV over, install or
release it) and migrations of running requests (snapshot, pause, install at the destination).

:class:`EngineMoves` is a part of :class:`xllm.core.engine.LLMEngine` (its base class), kept in its
own module; it works on the engine's state, which the engine owns and creates. Engine thread only.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from xllm.core.disagg import DisaggListener, Handoff, MoveReady, MoveSnapshot, Reservation
from xllm.core.engine_beams import install_beam_kv
from xllm.core.sequence import Phase, SeqStatus, Sequence
from xllm.engine_api.errors import InvalidRequestError
from xllm.proto.engine.v1 import engine_pb2

if TYPE_CHECKING:
    from xllm.core.config import EngineConfig
    from xllm.core.kv.base import KVCacheBackend
    from xllm.core.output_processor import OutputProcessor, RequestOutput
    from xllm.core.scheduler import Scheduler
    from xllm.core.step import StepInFlight
    from xllm.engine_api.stats import EngineCounters


class EngineMoves:
    """Hand-offs and migrations of :class:`~xllm.core.engine.LLMEngine` (see the module docstring)."""

    # the engine's state these methods use (created by LLMEngine.__init__)
    config: EngineConfig
    scheduler: Scheduler
    kv: KVCacheBackend
    outputs: OutputProcessor
    counters: EngineCounters
    requests: dict[str, RequestOutput]
    disagg: DisaggListener | None
    _in_flight: StepInFlight | None
    _abandoned: set[str]

    # ---- prefill/decode hand-offs (xllm.core.disagg) -------------------------------------------
    def _reserve(self) -> None:
        """Decode side: KV memory for the prompts of newly arrived decode-phase requests."""
        for seq in self.scheduler.reserve(self.config.max_num_seqs):
            self.disagg.on_reserved(Reservation(seq.request_id, seq.num_prompt_tokens, seq.num_computed_tokens,
                                                tuple(seq.kv_pages)))

    def _hand_off(self, out: RequestOutput, token: int, now: float) -> None:
        """Prefill side: the first token is out; keep the KV for the decode side and say so."""
        seq = out.seq
        self.scheduler.hand_off(seq)
        scheduled = seq.first_scheduled_time or seq.arrival_time
        full = seq.num_prompt_tokens // self.kv.layout.block_size
        self.disagg.on_handoff(Handoff(
            seq.request_id, out.kv_target, seq.num_prompt_tokens, tuple(seq.kv_pages), token,
            scheduled - seq.arrival_time, now - scheduled, now, tuple(self.kv.block_hashes_of(seq, full)[:full])))

    # ---- migrations (xllm.core.disagg) ----------------------------------------------------------
    def move_snapshot(self, request_id: str) -> MoveSnapshot | None:
        """Migration source: the KV the running request holds now (None: not running here)."""
        out = self.requests.get(request_id)
        if out is None or out.finished or out.seq.status is not SeqStatus.RUNNING:
            return None
        seq = out.seq
        computed = seq.num_computed_tokens
        if self._in_flight is not None:  # advanced as if it had run: that forward may still write it
            computed -= sum(n for s, n in self._in_flight.chunks if s is seq)
        return MoveSnapshot(request_id, computed, tuple(seq.kv_pages), seq.num_preemptions)

    def pause_for_move(self, request_id: str) -> bool:
        """Migration source: stop scheduling the running request, keep its KV and report
        :class:`MoveReady` once no step in flight computes it (now, or when that step landed).
        False if it is not running here (finished, unknown, queued, mid-hand-off)."""
        out = self.requests.get(request_id)
        if out is None or out.finished or out.seq.status is not SeqStatus.RUNNING:
            return False
        out.seq.moving = True
        if not self._computing(out.seq):
            self._pause(out.seq)
        return True

    def _computing(self, seq: Sequence) -> bool:
        return self._in_flight is not None and seq in self._in_flight.seqs

    def _pause(self, seq: Sequence) -> None:
        out = self.requests[seq.request_id]
        self.scheduler.hand_off(seq)
        self.disagg.on_move_ready(MoveReady(
            seq.request_id, seq.num_computed_tokens, tuple(seq.kv_pages), tuple(seq.prompt_ids + seq.real_output_ids),
            out.sent_chars, seq.num_preemptions))

    def _install_moved(self, seq: Sequence, commit: engine_pb2.KVCommit,
                       received: bool) -> list[engine_pb2.GenerateResponse]:
        """Migration destination: the reservation holds the KV of the first ``commit.num_tokens``
        tokens (``received``); the source's output after the reserved prompt joins it as earlier
        output, the output state is replayed to what the client has, and the request runs (its
        first step computes the tokens without KV and samples the next one)."""
        if commit.num_tokens > seq.num_prompt_tokens:
            raise InvalidRequestError(f"{commit.transfer_id}: the migrated KV covers {commit.num_tokens} tokens, "
                                      f"{seq.num_prompt_tokens} were reserved", "num_tokens")
        seq.prompt_ids.extend(commit.appended_tokens)
        seq.num_resumed += len(commit.appended_tokens)
        if received:
            seq.num_computed_tokens = max(seq.num_computed_tokens, commit.num_tokens)
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)  # the last one samples
        self.kv.on_computed(seq)
        seq.first_token_time = seq.last_token_time = time.time()  # its first token came long ago
        out = self.requests[seq.request_id] = self.outputs.new_request(seq, commit.sent_chars)
        self.scheduler.resume_with_kv(seq)
        if not out.finished:
            return []
        del self.requests[seq.request_id]
        self.scheduler.finish(seq)
        self.counters.finished_requests += 1
        return [self.outputs.take_chunk(out)]

    def install_kv(self, commit: engine_pb2.KVCommit, received: bool = True) -> list[engine_pb2.GenerateResponse]:
        """Decode side: the reserved pages hold the prompt's KV (``received``), or the transfer failed
        and this engine computes what its prefix cache lacked (a migration's final commit: see
        :meth:`_install_moved`). Either way decoding continues after
        the first token (sampled and streamed by the prefill side; later draws depend only on the
        seed and the output index).
        Returns chunks to deliver (only if the request ends right here; a beam request's empty chunk
        says this side took it over)."""
        seq = self.scheduler.awaiting_kv.get(commit.transfer_id)
        if seq is None or commit.transfer_id in self._abandoned:
            return self.release_kv(commit.transfer_id)
        if commit.migration == engine_pb2.MIGRATION_STAGE_FINAL:
            return self._install_moved(seq, commit, received)
        if commit.num_tokens != seq.num_prompt_tokens:
            raise InvalidRequestError(f"{commit.transfer_id}: the hand-off covers {commit.num_tokens} tokens, "
                                      f"the prompt has {seq.num_prompt_tokens}", "num_tokens")
        if seq.params.beam_width is not None:  # its last prompt row is computed here (xllm.core.engine_beams)
            install_beam_kv(seq, received)
            if received:
                self.kv.on_computed(seq)
            self.scheduler.resume_with_kv(seq)
            return [engine_pb2.GenerateResponse(request_id=seq.request_id)]  # no token: says the KV is here
        if received:
            seq.num_computed_tokens = seq.num_prompt_tokens
            self.kv.on_computed(seq)  # the received blocks join the local prefix cache
        out = self.requests[seq.request_id]
        seq.output_ids.append(commit.first_token)
        seq.first_token_time = seq.last_token_time = time.time()
        self.outputs.append_token(out, commit.first_token, None)
        chunk = self.outputs.take_chunk(out)  # the prefill side streamed this token; only the state advances
        self.scheduler.resume_with_kv(seq)
        if not out.finished:
            return []
        del self.requests[seq.request_id]
        self.scheduler.finish(seq)
        return [chunk]

    def release_kv(self, request_id: str) -> list[engine_pb2.GenerateResponse]:
        """A hand-off is over. Prefill side (or a migration's source): free the KV (its blocks stay
        in the prefix cache) and end the request's stream (``FINISH_REASON_HANDED_OFF``). Decode
        side: drop a reservation that will not be used (abandoned, expired)."""
        seq = self.scheduler.handing_off.get(request_id) or self.scheduler.awaiting_kv.get(request_id)
        if seq is None:
            return []
        self.scheduler.finish(seq)
        abandoned = request_id in self._abandoned
        self._abandoned.discard(request_id)
        out = self.requests.pop(request_id, None)
        if out is None or abandoned:
            return []
        self.counters.finished_requests += 1
        if seq.phase is Phase.DECODE and not seq.moving:  # expired: fails here (the gateway resumes it elsewhere)
            self.outputs.fail(out, "the prompt's KV never arrived")
            return [self.outputs.take_chunk(out)]
        return [self.outputs.handed_off_chunk(out)]
