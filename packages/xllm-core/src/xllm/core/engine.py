"""The synchronous engine: one ``step()`` = schedule, forward, sample, emit.

Not thread-safe: all methods are called from one thread (the
:class:`~xllm.core.async_engine.AsyncEngine` loop thread in a server), except
:meth:`LLMEngine.validate`.

What lives where: the queues, admission and preemption in
:class:`~xllm.core.scheduler.Scheduler`; packing and the forward in
:class:`~xllm.core.model_runner.ModelRunner`; one step's inputs and forward in
:class:`~xllm.core.step.StepInFlight`; stop conditions and stream chunks in
:class:`~xllm.core.output_processor.OutputProcessor`. The engine runs the loop
and keeps the per-request output state and the counters, and serves either side
of a prefill/decode hand-off (:mod:`xllm.core.disagg`) once a listener that moves the KV is
attached (:meth:`LLMEngine.attach_disagg`). Its parts are built by :mod:`xllm.core.engine_build`;
the engine service drives it through :class:`~xllm.core.async_engine.AsyncEngine`, its handle.
"""

from __future__ import annotations

import logging
import random
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from xllm.core.beam_check import check_beam_request
from xllm.core.compute_thread import run_on
from xllm.core.config import EngineConfig
from xllm.core.detokenizer import EngineTokenizer
from xllm.core.disagg import DisaggListener, PromptFinishing
from xllm.core.embedding import EngineEmbeddings
from xllm.core.engine_beams import EngineBeams, beam_stats
from xllm.core.engine_build import (
    attach_tiers,
    build_beams,
    build_kv,
    build_platform,
    build_runner,
    build_scheduler,
    build_spec,
    build_step_timing,
    build_worker,
)
from xllm.core.engine_moves import EngineMoves
from xllm.core.engine_weights import EngineWeights, WeightsState
from xllm.core.grammar import Grammars
from xllm.core.images import admit_images, image_token_bytes, max_encode_images
from xllm.core.lora import EngineLora, build_loras
from xllm.core.model_api import CausalLM
from xllm.core.output_processor import OutputProcessor, RequestOutput
from xllm.core.platform import Platform
from xllm.core.request_trace import RequestTrace, record_step
from xllm.core.sampler import Sampler
from xllm.core.sampling_params import SamplingParams
from xllm.core.sequence import PLACEHOLDER, Phase, PromptLogprobs, SeqStatus, Sequence
from xllm.core.spec.speculator import Speculator
from xllm.core.step import StepInFlight
from xllm.core.step_stats import expert_stats, finished_request, image_stats, offline_scheduling, spec_stats
from xllm.core.validation import RequestLimits
from xllm.engine_api.errors import EngineOverloadedError, InvalidRequestError
from xllm.engine_api.stats import EngineCounters, FinishedRequest, OfflineStepStats, StatsObserver, StepStats
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.enums import finish_reason_name
from xllm.proto.registry.v1 import instance_pb2
from xllm.sched import StepPlan
from xllm.sched.latency import StepSample, step_shape

if TYPE_CHECKING:
    from xllm.core.executor.group import RankGroup
    from xllm.core.kv.layout import KVCacheLayout
    from xllm.core.kv.page_store import PageAccess

log = logging.getLogger(__name__)


class LLMEngine(EngineMoves, EngineBeams, EngineLora, EngineWeights, EngineEmbeddings):
    """Continuous-batching engine over one model instance (``model`` satisfies
    :class:`~xllm.core.model_api.CausalLM`)."""

    def __init__(self, model: CausalLM, tokenizer: EngineTokenizer, config: EngineConfig,
                 observers: list[StatsObserver] | None = None, instance_id: str = "engine-0",
                 forward_executor: Executor | None = None, grammars: Grammars | None = None,
                 draft_model: CausalLM | None = None, ranks: RankGroup | None = None) -> None:
        """Build the engine's parts (:mod:`xllm.core.engine_build`) in order and keep them. ``ranks``: the
        worker ranks of a tensor-parallel instance (``config.tensor_parallel_size`` > 1; ``model`` is then
        rank 0's shard), which the engine stops when it closes (also when building it fails)."""
        try:
            self._build(model, tokenizer, config, observers, instance_id, forward_executor, grammars, draft_model,
                        ranks)
        except BaseException:
            if ranks is not None:
                ranks.close()
            raise

    def _build(self, model: CausalLM, tokenizer: EngineTokenizer, config: EngineConfig,
               observers: list[StatsObserver] | None, instance_id: str, forward_executor: Executor | None,
               grammars: Grammars | None, draft_model: CausalLM | None, ranks: RankGroup | None) -> None:
        self.config = config
        self.grammars = grammars  # constrained decoding (xllm.core.grammar); None: such requests are refused
        self.instance_id = instance_id
        self.platform: Platform = build_platform(config, grammars)
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = config.resolve_max_model_len(int(model.max_context_len))
        self.kv = build_kv(config, model, self.platform.device, self.max_model_len)
        self.layout = self.kv.layout
        self.limits = RequestLimits(int(model.vocab_size), self.max_model_len, self.layout, config.request_bounds,
                                    image_token_bytes(model))
        self.runner = build_runner(config, model, self.kv, self.platform.device, ranks)
        self.loras = build_loras(config, model, self.runner)  # LoRA adapters (xllm.core.lora)
        self.weights = WeightsState()  # sleep, wake, weight updates (xllm.core.engine_weights)
        if config.kv_tiers_enabled:  # through the transfer store: every rank's KV heads with tensor parallelism
            attach_tiers(config, self.kv, self.transfer_store())
        eos = frozenset(tokenizer.eos_token_ids)
        self.sampler = Sampler(eos)
        self.outputs = OutputProcessor(tokenizer, eos, self.max_model_len)
        self.step_timing = build_step_timing(config)  # fed every step (shape in _prepare, time in _account)
        self.max_encode_images = max_encode_images(config, model)  # (also bounds Encode calls between steps)
        self.scheduler = build_scheduler(config, self.kv, self.step_timing, self.max_encode_images)
        self.spec: Speculator | None = build_spec(config, model, draft_model, self.runner, self.max_model_len,
                                                  self.platform.device)
        self.beams = build_beams(config, model, self.kv, tokenizer, eos, self.runner)
        self.requests: dict[str, RequestOutput] = {}
        self.counters = EngineCounters()
        self.observers = list(observers or [])
        self._seed_source = random.Random(config.seed)
        self._reported_prefix = self.kv.prefix_stats
        self._in_flight: StepInFlight | None = None
        self._step_began = 0.0  # perf_counter at the start of the current step() (StepTiming's measure)
        self.disagg: DisaggListener | None = None  # who moves KV in hand-offs (attach_disagg: an engine server)
        self._abandoned: set[str] = set()  # aborted mid-hand-off: KV kept until release_kv
        self._traced: weakref.WeakSet[Sequence] = weakref.WeakSet()  # live traced requests (record_step)
        self.stalled = False  # the last step had nothing it could run
        self._stepping: list[Sequence] = []  # the sequences of the step being prepared/run (stepping_request_ids)
        self._worker, self._owns_worker = build_worker(config, forward_executor)  # async scheduling's forwards
        log.info("engine %s: max_model_len=%d kv=%s blocks=%d x %d tokens (%d tokens) prefix_cache=%s "
                 "max_num_seqs=%d", instance_id, self.max_model_len, type(self.kv).__name__, self.layout.num_blocks,
                 self.layout.block_size, self.layout.capacity_tokens, self.layout.enable_prefix_cache,
                 config.max_num_seqs)

    def attach_disagg(self, listener: DisaggListener) -> None:
        """Serve prefill/decode hand-offs and migrations, reporting them to ``listener`` (the engine
        service's hand-off side; :mod:`xllm.core.disagg`). Until one is attached, hand-off requests
        are refused; a tensor-parallel instance without a :meth:`transfer_store` never attaches one."""
        if self.config.tensor_parallel_size > 1 and self.transfer_store() is None:
            log.info("engine %s: --tensor-parallel-size %d with this KV cache (--kv-cache-backend %s, "
                     "--kv-cache-dtype %s) serves no prefill/decode hand-offs or migrations", self.instance_id,
                     self.config.tensor_parallel_size, self.config.kv_cache_backend, self.config.kv_cache_dtype)
            return
        self.disagg = listener

    @property
    def transfer_layout(self) -> KVCacheLayout:
        """The KV layout hand-offs speak: the whole model's KV heads (a tensor-parallel instance's rank 0
        holds some; its :meth:`transfer_store` gathers every rank's)."""
        return getattr(self.runner, "transfer_layout", self.layout)

    def transfer_store(self) -> PageAccess | None:
        """The KV pages hand-offs read and write, in :attr:`transfer_layout` (None: no hand-offs)."""
        if self.config.tensor_parallel_size > 1:
            return self.runner.transfer_store()  # type: ignore[attr-defined]
        return self.kv.page_store()

    def add_observer(self, observer: StatsObserver) -> None:
        """Tell ``observer`` about every step from now on (on the engine thread)."""
        self.observers.append(observer)

    # ---- requests -------------------------------------------------------
    def validate(self, req: engine_pb2.GenerateRequest) -> SamplingParams:
        """Check a request against this engine's limits without queuing it (any thread).
        Raises :class:`InvalidRequestError` naming the offending parameter. An output constraint is
        compiled here (into the grammar cache), off the engine thread."""
        params = self.limits.check(req)
        self._check_lora_name(req)
        if req.sampling.HasField("structured") and self.grammars is not None:
            self.grammars.compile(req.sampling.structured)
        return params

    def add_request(self, req: engine_pb2.GenerateRequest,
                    trace: RequestTrace | None = None) -> list[engine_pb2.GenerateResponse]:
        """Queue a request; raises :class:`InvalidRequestError` or :class:`EngineOverloadedError`.
        Returns chunks to deliver at once: only a resumed request whose earlier run had already
        ended (its final chunk was lost) ends here, with that chunk, without being queued. ``trace``:
        filled after each of its steps (:mod:`xllm.core.request_trace`)."""
        params = self.validate(req)
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request_id {req.request_id!r} is already in flight", "request_id")
        if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
            raise EngineOverloadedError(f"{len(self.scheduler.waiting)} requests already waiting")
        phase = _PHASES.get(req.disagg_phase)
        if phase is None or (phase is not Phase.MIXED and self.disagg is None):
            raise InvalidRequestError("this engine does not serve prefill/decode hand-offs", "disagg_phase")
        if phase is Phase.PREFILL and not req.HasField("kv_target"):
            raise InvalidRequestError("a prefill-phase request needs its kv_target", "kv_target")
        if phase is not Phase.MIXED and self.transfer_store() is None:
            raise InvalidRequestError(f"the {self.config.kv_cache_backend} KV backend cannot hand KV off",
                                      "disagg_phase")
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        seq = Sequence(req.request_id, list(req.prompt_token_ids), params, req.arrival_time or time.time(),
                       req.priority, seed=seed, num_resumed=req.resumed_output_tokens, phase=phase,
                       offline=req.offline)
        self._admit_lora(seq, req)
        admit_images(self.model, seq, req, self.spec is not None, self.config.kv_model_identity or "")
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = PromptLogprobs()
        if params.beam_width is not None:
            check_beam_request(params, phase is Phase.PREFILL, req, self.beams.catalog, self.max_model_len,
                               self.layout.capacity_tokens)
        if req.sampling.HasField("structured"):
            if self.grammars is None:
                raise InvalidRequestError("this engine has no grammar engine (constrained decoding)",
                                          req.sampling.structured.field or "structured")
            seq.grammar = self.grammars.state(req.sampling.structured)
        out = self.outputs.new_request(seq, req.resumed_sent_chars)
        if out.finished:
            self.counters.finished_requests += 1
            return [self.outputs.take_chunk(out)]
        out.kv_target = req.kv_target if phase is Phase.PREFILL else None
        if trace is not None:
            seq.trace = trace
            self._traced.add(seq)
        self.requests[req.request_id] = out
        self._enqueue(seq)  # (to the scheduler, or waiting for a LoRA adapter slot: xllm.core.lora)
        return []

    def abort(self, request_id: str) -> engine_pb2.GenerateResponse | None:
        """Cancel a request; returns its final (aborted) chunk, or None if unknown."""
        out = self.requests.pop(request_id, None)
        if out is None:
            return None
        seq = out.seq
        if seq.request_id in self.scheduler.awaiting_kv or seq.request_id in self.scheduler.handing_off:
            # a transfer may be reading or writing its pages: they go when the hand-off ends (release_kv)
            self._abandoned.add(seq.request_id)
            self.disagg.on_abandoned(seq.request_id)
        else:
            self.beams.drop(seq)
            self.scheduler.finish(seq)
            if seq.phase is Phase.PREFILL:  # before its hand-off began: none will happen
                self.disagg.on_abandoned(seq.request_id)
        self.outputs.abort(out)
        chunk = self.outputs.take_chunk(out)
        self.counters.finished_requests += 1
        self._notify_outside_step(finished=[finished_request(seq, "abort", time.time())],
                                  offline=OfflineStepStats(finished=int(seq.offline)))
        return chunk

    def _notify_outside_step(self, **fields) -> None:
        """Report what happened between steps (an abort, an encode instance's ``Encode``): no forward."""
        self._notify(StepStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting), batch_size=0,
            num_decode_tokens=0, num_prefill_tokens=0, num_preempted=0, kv_usage=self.kv.usage, step_time=0.0,
            **fields))

    def stepping_request_ids(self) -> set[str]:
        """Requests of the step being scheduled, prepared or computed (with async scheduling, also
        the one in flight): the suspects when a step raises."""
        seqs = set(self._stepping)
        if self._in_flight is not None:
            seqs |= self._in_flight.seqs | set(self._in_flight.beam_pass.seqs if self._in_flight.beam_pass else ())
        return {s.request_id for s in seqs}

    def has_work(self) -> bool:
        return (self.scheduler.has_work() or self._in_flight is not None or bool(self.beams.groups)
                or bool(self.loras.parked))

    def all_decoding(self) -> bool:
        """Nothing waits and every running request decodes (one token per step)."""
        return self.scheduler.all_decoding()

    def unfinished_request_ids(self) -> list[str]:
        """The requests running, then those waiting."""
        return self.scheduler.request_ids()

    def add_step_listener(self, listener: Callable[[StepSample], None]) -> None:
        """``listener`` hears every step the step timing observes (its shape and seconds; engine thread)."""
        self.step_timing.listeners.append(listener)

    def remove_step_listener(self, listener: Callable[[StepSample], None]) -> None:
        self.step_timing.listeners.remove(listener)

    # ---- the step -------------------------------------------------------
    def step(self) -> list[engine_pb2.GenerateResponse]:
        """Run one iteration and return the stream chunks it produced.

        Synchronous: schedule, forward, sample, emit. With ``async_scheduling``
        the forward of step k runs on a worker thread while this thread
        schedules and prepares step k+1 (with placeholder tokens for step k's
        outputs, swapped in when they land) and then detokenizes and emits step
        k's outputs during step k+1's forward; chunks therefore trail by one step.
        """
        self._step_began = time.perf_counter()
        self._reserve()
        self._lora_unpark()
        if self.config.async_scheduling:
            return self._step_overlapped()
        plan = self._schedule()
        self.stalled = not plan and not plan.encodes and not self.beams.groups
        if not plan:  # beam groups alone (else they ride in the plan's forward: StepInFlight.beam_pass)
            return self._beam_step() if self.beams.groups else []
        flight = self._prepare(plan)
        flight.start(None)
        self._swap_in(flight)
        responses = self._emit(flight)
        self._stepping = []
        return responses

    def _step_overlapped(self) -> list[engine_pb2.GenerateResponse]:
        responses: list[engine_pb2.GenerateResponse] = []
        prev = self._in_flight
        if prev is not None and (self._kv_tight() or self._slots_tight()):
            # preemption must never free pages an in-flight forward writes: land it first
            self._in_flight = None
            self._swap_in(prev)
            responses += self._emit(prev)
            prev = None
        busy = prev.sampled_seqs if prev is not None else set()
        # sequences whose in-flight token is their last one are not scheduled again, nor are those
        # a migration stops (paused once their step landed)
        parked = {s for s in self.scheduler.running if (s in busy and self._saturated(s)) or s.moving}
        if self.spec is not None and prev is not None:
            # a verify step's accepted length is unknown until it lands, and drafts need a sequence's
            # real last token: speculating sequences step synchronously (xllm.core.spec.speculator)
            parked |= set(prev.spec_starts) | {s for s in busy if self.spec.wants(s)}
        plan = self._schedule(hold=parked)
        self.stalled = not plan and not plan.encodes and prev is None and not self.beams.groups
        flight = self._prepare(plan) if plan else None
        if prev is not None:
            self._swap_in(prev)
        if flight is not None:
            flight.patch_placeholders()
            self.scheduler.pin(flight.seqs)
            flight.start(self._worker)
        self._in_flight = flight
        if prev is not None:
            self._stepping = list(prev.seqs)  # emitting it may still fail
            responses += self._emit(prev)  # overlaps the forward just started
        self._stepping = []
        if flight is None and self.beams.groups:  # beam groups alone, now that nothing is in flight
            responses += self._beam_step()
        return responses

    def _schedule(self, hold: set[Sequence] | frozenset[Sequence] = frozenset()) -> StepPlan:
        plan = self.scheduler.schedule(hold)
        self.counters.num_preemptions += len(plan.preempted)
        if plan.encodes:  # the encode phase (xllm.sched.encode), on the thread that runs the forwards
            run_on(self._worker, self.runner.encode, plan.encodes)
        return plan

    def _prepare(self, plan: StepPlan) -> StepInFlight:
        """Pack the step's inputs and advance its sequences as if it had run; each
        sequence that samples this step gets a placeholder for its new token."""
        chunks = [(c.seq, c.num_tokens) for c in plan.chunks]
        self._stepping = [seq for seq, _ in chunks] + [g.seq for g in self.beams.groups]  # (beams ride along)
        drafts: dict[Sequence, list[int]] = {}
        if self.spec is not None:  # decode chunks become the last token + drafts (xllm.core.spec)
            decodes = {seq for seq, n in chunks if n == 1 and seq.num_computed_tokens > 0
                       and seq.num_tokens - seq.num_computed_tokens == 1}
            drafts = self.spec.draft([seq for seq, _ in chunks if seq in decodes], self.kv,
                                     self.config.max_num_batched_tokens - plan.num_tokens, self.max_model_len)
            if drafts:  # plain decodes stay first; verify chunks lead the multi-token chunks
                chunks = ([(seq, n) for seq, n in chunks if seq in decodes and seq not in drafts]
                          + [(seq, n + len(drafts[seq])) for seq, n in chunks if seq in drafts]
                          + [(seq, n) for seq, n in chunks if seq not in decodes])
        shape = step_shape(chunks)  # before num_computed_tokens advances
        batch = self.runner.prepare(chunks, drafts)
        self.kv.prefetch(batch.sample_seqs)  # map next step's pages while this one computes
        now = time.time()
        for seq, n in chunks:
            seq.num_computed_tokens += n
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        flight = StepInFlight(plan, chunks, batch, self.runner, self.sampler, time.perf_counter(), shape=shape,
                              began=self._step_began, grammars=self.grammars, beams=self.beams)
        flight.spec_starts = {seq: seq.num_computed_tokens - n for seq, n in chunks if seq in drafts}
        for seq in batch.sample_seqs:
            flight.placeholder_at.append(len(seq.output_ids))
            seq.output_ids.append(PLACEHOLDER)
        finishing = [seq for seq in batch.sample_seqs if seq.phase is Phase.PREFILL]
        if finishing:  # these prompts' KV becomes final during this forward: a transport may stream it
            flight.on_layer = self.disagg.on_prompt_finishing([
                PromptFinishing(seq.request_id, self.requests[seq.request_id].kv_target, seq.num_prompt_tokens,
                                tuple(seq.kv_pages)) for seq in finishing])
        return flight

    def _swap_in(self, flight: StepInFlight) -> None:
        """Wait for the forward, put the sampled tokens in place of the placeholders."""
        flight.wait()
        if self.spec is not None and flight.beam_pass is None:  # prices decode/verify rows (xllm.core.spec.costs)
            self.spec.observe_step(flight.batch, flight.forward_seconds)
        for v in flight.verified:  # before the prefix cache sees them: rejected rows roll back
            self.spec.land(v, flight.spec_starts[v.seq])
        for seq, _ in flight.chunks:
            self.kv.on_computed(seq)
        for i, seq in enumerate(flight.batch.sample_seqs):
            seq.output_ids[flight.placeholder_at[i]] = flight.result.token_ids[i]
        for seq, first, entries in flight.prompt_logprobs:
            if seq.prompt_logprobs is not None and len(seq.prompt_logprobs.entries) == first:
                seq.prompt_logprobs.entries.extend(entries)
        self.scheduler.unpin()

    def _emit(self, flight: StepInFlight) -> list[engine_pb2.GenerateResponse]:
        """Detokenize and check stop conditions for a landed step; retire finished requests."""
        responses: list[engine_pb2.GenerateResponse] = []
        now = time.time()
        prompt_tokens = 0
        ttfts, itls, finished = [], [], []  # (seconds, seconds, FinishedRequest)
        offline = OfflineStepStats()
        result = flight.result
        for i, seq in enumerate(flight.batch.sample_seqs):
            out = self.requests.get(seq.request_id)
            if out is None or out.seq is not seq or out.finished:
                continue  # aborted, or its end was detected while this token was in flight
            if seq.params.beam_width is not None:  # the prompt is done: its beams decode as a group from here
                chunks, counted = self._beam_prompt_done(seq, out, flight, i, now, ttfts, finished)
                responses += chunks
                prompt_tokens += counted
                continue
            token = result.token_ids[i]
            if seq.first_token_time is None:
                seq.first_token_time = now
                ttfts.append(now - seq.arrival_time)
                prompt_tokens += seq.num_prompt_tokens
                offline.prompt_tokens += seq.num_prompt_tokens if seq.offline else 0
            else:
                itls.append(now - seq.last_token_time)
            seq.last_token_time = now
            offline.generation_tokens += seq.offline
            self.outputs.append_token(out, token, result.logprobs[i])
            responses.append(self.outputs.take_chunk(out))
            if seq.prompt_logprobs is not None and not seq.prompt_logprobs.sent:
                _attach_prompt_logprobs(responses[-1], seq)
            if out.finished:
                del self.requests[seq.request_id]
                self.scheduler.finish(seq)
                finished.append(finished_request(seq, finish_reason_name(out.finish_reason), now))
                offline.finished += seq.offline
                if seq.phase is Phase.PREFILL:  # the first token ended it: nothing to hand off
                    self.disagg.on_abandoned(seq.request_id)
            elif seq.phase is Phase.PREFILL:
                self._hand_off(out, token, now)
        spec_tokens = self._emit_verified(flight, now, responses, itls, finished, offline)
        if flight.beam_pass is not None:  # the groups that rode in this forward
            responses += self._beams_done(flight.beam_pass.result, finished, now)
        for seq, _ in flight.chunks:
            if seq.moving and seq.status is SeqStatus.RUNNING and not self._computing(seq):
                self._pause(seq)
        self._account(flight, prompt_tokens, ttfts, itls, finished, time.perf_counter() - flight.started, offline,
                      spec_tokens)
        return responses

    def _emit_verified(self, flight: StepInFlight, now: float, responses: list[engine_pb2.GenerateResponse],
                       itls: list[float], finished: list[FinishedRequest], offline: OfflineStepStats) -> int:
        """The speculating sequences' verified runs, token by token through the stop checks (a run
        ends exactly where the request would have); one chunk per request. Returns tokens emitted."""
        emitted = 0
        for v in flight.verified:
            seq = v.seq
            out = self.requests.get(seq.request_id)
            if out is None or out.seq is not seq or out.finished:
                continue
            gap = (now - (seq.last_token_time or now)) / len(v.tokens)
            for i, (token, logprob) in enumerate(zip(v.tokens, v.logprobs, strict=True)):
                itls.append(gap)
                emitted += 1
                offline.generation_tokens += seq.offline
                self.outputs.append_token(out, token, logprob)
                if out.finished:  # the tokens after the stop were never generated
                    del seq.output_ids[len(seq.output_ids) - (len(v.tokens) - i - 1):]
                    break
            seq.last_token_time = now
            responses.append(self.outputs.take_chunk(out))
            if out.finished:
                del self.requests[seq.request_id]
                self.scheduler.finish(seq)
                finished.append(finished_request(seq, finish_reason_name(out.finish_reason), now))
                offline.finished += seq.offline
        return emitted

    def _saturated(self, seq: Sequence) -> bool:
        """Whether the token in flight is certainly the sequence's last here (length limits; a
        prefill-phase sequence stops at its first token)."""
        return (seq.num_resumed + len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
                or seq.phase is Phase.PREFILL or seq.params.beam_width is not None)

    def _slots_tight(self) -> bool:
        """Could this step's scheduling preempt an offline sequence for a waiting one's slot?
        (co-location's batch_full preemption: every slot taken, offline work among them)"""
        s = self.scheduler
        return (bool(s.waiting) and len(s.running) >= self.config.max_num_seqs
                and any(seq.offline for seq in s.running))

    def _kv_tight(self) -> bool:
        """Could this step's scheduling preempt? (fewer free blocks than it might need)"""
        bs = self.layout.block_size
        running = len(self.scheduler.running)
        return self.kv.num_free_blocks < running + -(-self.config.max_num_batched_tokens // bs) + 1

    def _account(self, flight: StepInFlight, prompt_tokens: int, ttfts: list[float], itls: list[float],
                 finished: list[FinishedRequest], step_time: float, offline: OfflineStepStats,
                 spec_tokens: int = 0) -> None:
        plan, batch, c = flight.plan, flight.batch, self.counters
        offline_scheduling(plan, offline)
        c.observe_offline(offline)
        c.offline_longest_wait = offline.longest_wait
        # the step's time as StepTiming defines it (xllm.core.step_timing): synchronous, the whole step
        # from scheduling to here; overlapped, its forward and sampling on the worker
        measured = flight.forward_seconds if self.config.async_scheduling else time.perf_counter() - flight.began
        beams = flight.beam_pass.result if flight.beam_pass is not None else None  # not in the step's shape
        prediction_error = self.step_timing.observe(flight.shape, measured) if beams is None else None
        c.steps += 1
        c.prompt_tokens += prompt_tokens
        c.generation_tokens += len(batch.sample_seqs) + spec_tokens
        c.finished_requests += len(finished)
        c.max_batch_size = max(c.max_batch_size, len(plan.chunks))
        if batch.num_decode > 1:
            c.multi_seq_decode_steps += 1
        c.observe_latency(ttfts, itls)
        if self._traced:
            record_step(flight, time.perf_counter(), time.time())
        if not self.observers:
            return
        prefix, before = self.kv.prefix_stats, self._reported_prefix
        self._reported_prefix = prefix
        self._notify(StepStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            batch_size=len(plan.chunks) + (beams.steps if beams else 0),
            num_decode_tokens=batch.num_decode + (beams.rows if beams else 0),
            num_prefill_tokens=plan.num_tokens - batch.num_decode, num_preempted=len(plan.preempted),
            kv_usage=self.kv.usage, step_time=step_time, prompt_tokens=prompt_tokens, ttfts=ttfts,
            inter_token_latencies=itls, finished=finished, prefix_cache_queries=prefix.queries - before.queries,
            prefix_cache_hits=prefix.hits - before.hits, step_time_prediction_error=prediction_error,
            offline=offline, **spec_stats(flight), **beam_stats(beams, flight.beam_starts),
            **expert_stats(self.runner), **image_stats(self.runner)))

    def _notify(self, stats: StepStats) -> None:
        for obs in self.observers:
            obs.on_step(stats)

    def close(self) -> None:
        """Release the KV memory's OS resources and stop the worker ranks of a tensor-parallel instance;
        the engine is unusable afterwards. A step in flight that failed (the loop already died of it) does
        not stop the rest."""
        if self._in_flight is not None:
            try:
                self._in_flight.wait()
            except Exception:
                log.warning("engine %s: the step in flight at close failed", self.instance_id, exc_info=True)
            self._in_flight = None
        close_runner = getattr(self.runner, "close", None)
        if close_runner is not None:
            close_runner()
        if self._owns_worker and self._worker is not None:
            self._worker.shutdown(wait=True)
        if self.grammars is not None:
            self.grammars.close()
        if self.spec is not None:
            self.spec.close()
        self.beams.close()
        self.kv.close()

    # ---- reports ----------------------------------------------------------
    def load_report(self) -> instance_pb2.LoadReport:
        return instance_pb2.LoadReport(
            instance_id=self.instance_id, num_running=len(self.scheduler.running) + len(self.beams.groups),
            num_waiting=len(self.scheduler.waiting), kv_usage=self.kv.usage, kv_free_tokens=self.kv.free_tokens,
            recent_ttft=self.counters.recent_ttft, recent_tpot=self.counters.recent_tpot, timestamp=time.time(),
            decode_context_tokens=sum(seq.num_tokens for seq in self.scheduler.running),
            step_predictor=self.step_timing.report(self.config.max_num_batched_tokens),
            offline_longest_wait=self.counters.offline_longest_wait,
            offline_running=sum(s.offline for s in self.scheduler.running),
            offline_waiting=sum(s.offline for s in self.scheduler.waiting),
            tier_load_tokens_per_s=tier_load_rates(self.kv.tier_stats(), self.layout.block_size),
            **self.lora_load_fields())


def tier_load_rates(stats: dict, block_size: int) -> dict[str, float]:
    """Per lower tier the measured speed of bringing prompt tokens up from it (blocks read intact
    times ``block_size`` over the time reading them), for the tiers that have been read from."""
    return {name: s.hits * block_size / s.load_seconds for name, s in stats.items()
            if s.hits and s.load_seconds > 0}


_PHASES = {engine_pb2.DISAGG_PHASE_NONE: Phase.MIXED, engine_pb2.DISAGG_PHASE_PREFILL: Phase.PREFILL,
           engine_pb2.DISAGG_PHASE_DECODE: Phase.DECODE}


def _attach_prompt_logprobs(chunk: engine_pb2.GenerateResponse, seq: Sequence) -> None:
    """The prompt's logprobs on the request's first output chunk (none for a resumed run: its first
    run sent them)."""
    seq.prompt_logprobs.sent = True
    if seq.num_resumed:
        return
    for token, logprob, top in seq.prompt_logprobs.entries:
        chunk.prompt_logprobs.add(token_id=token, logprob=logprob,
                                  top=[engine_pb2.TopLogprob(token_id=t, logprob=v) for t, v in top])
