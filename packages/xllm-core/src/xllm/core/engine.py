"""The synchronous engine: one ``step()`` = schedule, forward, sample, emit.

Not thread-safe: all methods are called from one thread (the
:class:`~xllm.core.async_engine.AsyncEngine` loop thread in a server).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from concurrent.futures import Executor, ThreadPoolExecutor

import torch

from xllm.core.config import EngineConfig
from xllm.core.errors import EngineOverloadedError, InvalidRequestError
from xllm.core.kv import build_kv_cache
from xllm.core.model_api import CausalLM
from xllm.core.model_runner import ModelRunner
from xllm.core.output_processor import OutputProcessor, RequestOutput
from xllm.core.platform import Platform, configure_threads, detect_platform
from xllm.core.sampler import Sampler
from xllm.core.sampling_params import SamplingParams
from xllm.core.sequence import PLACEHOLDER, SeqStatus, Sequence
from xllm.core.stats import EngineCounters, FinishedRequest, StatsObserver, StepStats
from xllm.core.step import StepInFlight
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.registry.v1 import instance_pb2
from xllm.sched import StepPlan, batch_policy

log = logging.getLogger(__name__)

_REASON_NAMES = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
    engine_pb2.FINISH_REASON_ERROR: "error",
}


class LLMEngine:
    """Continuous-batching engine over one model instance.

    ``model`` satisfies :class:`~xllm.core.model_api.CausalLM` and carries
    ``max_context_len``; ``tokenizer`` decodes ids (``decode``) and names its
    ``eos_token_ids``.
    """

    def __init__(self, model: CausalLM, tokenizer, config: EngineConfig,
                 observers: list[StatsObserver] | None = None, instance_id: str = "engine-0",
                 forward_executor: Executor | None = None) -> None:
        self.config = config
        self.instance_id = instance_id
        self.platform: Platform = detect_platform(config.device)
        if not self.platform.supports_dtype(config.dtype):
            raise ValueError(f"dtype {config.dtype} is not supported on {self.platform.name}")
        configure_threads(config.num_threads)
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = config.resolve_max_model_len(int(model.max_context_len))
        self.kv = build_kv_cache(config.kv_cache_backend, model.kv_cache_spec(), config.dtype, self.platform.device,
                                 config.max_num_seqs, self.max_model_len, config.kv_cache_memory_gib,
                                 config.block_size, config.enable_prefix_cache)
        self.layout = self.kv.layout
        self.runner = ModelRunner(model, self.kv, self.platform.device, native_decode=config.native_decode)
        if config.compile_decode:
            self._build_decode_graph()
        eos = frozenset(getattr(tokenizer, "eos_token_ids", ()))
        self.sampler = Sampler(eos)
        self.outputs = OutputProcessor(tokenizer, eos, self.max_model_len)
        self.policy = batch_policy("decode_first", max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens)
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.requests: dict[str, RequestOutput] = {}
        self.counters = EngineCounters()
        self.observers = list(observers or [])
        self._seed_source = random.Random(config.seed)
        self._reported_prefix = (0, 0)
        self._in_flight: StepInFlight | None = None
        self._free_after_flight: dict[int, list[Sequence]] = {}
        # async scheduling: forwards run here (the caller's ComputeThread, so that loading and
        # forwards share one OpenMP pool; see xllm.core.compute_thread), or on a worker of our own
        self._owns_worker = config.async_scheduling and forward_executor is None
        self._worker: Executor | None = None
        if config.async_scheduling:
            self._worker = forward_executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="xllm-forward")
        log.info("engine %s: max_model_len=%d kv=%s blocks=%d x %d tokens (%d tokens) prefix_cache=%s "
                 "max_num_seqs=%d", instance_id, self.max_model_len, type(self.kv).__name__, self.layout.num_blocks,
                 self.layout.block_size, self.layout.capacity_tokens, self.layout.enable_prefix_cache,
                 config.max_num_seqs)

    # ---- requests -------------------------------------------------------
    def validate(self, req: engine_pb2.GenerateRequest) -> SamplingParams:
        """Check a request against this engine's limits without queuing it.

        Safe to call from any thread (reads only immutable settings). Raises
        :class:`InvalidRequestError` naming the offending parameter.
        """
        if not req.request_id:
            raise InvalidRequestError("request_id is required", "request_id")
        params = SamplingParams.from_proto(req.sampling)
        prompt = req.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = int(getattr(self.model, "vocab_size", 0))
        if vocab and (min(prompt) < 0 or max(prompt) >= vocab):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if vocab and any(not 0 <= t < vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens but the context length is {self.max_model_len}", "prompt")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"length {self.max_model_len}", "max_tokens")
        # A sequence that cannot fit the whole KV pool on its own would be preempted and
        # re-admitted forever (the engine would never finish it): reject it up front.
        capacity = self.layout.capacity_tokens
        if self.layout.blocks_for(len(prompt) + params.max_tokens) > self.layout.num_blocks:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the KV cache "
                f"capacity of {capacity} tokens", "prompt" if len(prompt) > capacity else "max_tokens")
        return params

    def add_request(self, req: engine_pb2.GenerateRequest) -> None:
        """Queue a request; raises :class:`InvalidRequestError` or :class:`EngineOverloadedError`."""
        params = self.validate(req)
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request_id {req.request_id!r} is already in flight", "request_id")
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise EngineOverloadedError(f"{len(self.waiting)} requests already waiting")
        prompt = list(req.prompt_token_ids)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(params.seed if params.seed is not None else self._seed_source.getrandbits(63))
        seq = Sequence(req.request_id, prompt, params, req.arrival_time or time.time(), req.priority, gen)
        self.requests[req.request_id] = self.outputs.new_request(seq)
        self._enqueue(seq)

    def abort(self, request_id: str) -> engine_pb2.GenerateResponse | None:
        """Cancel a request; returns its final (aborted) chunk, or None if unknown."""
        out = self.requests.pop(request_id, None)
        if out is None:
            return None
        seq = out.seq
        if seq in self.waiting:
            self.waiting.remove(seq)
        if any(s is seq for s in self.running):
            self.running.remove(seq)
        if not self._free_later_if_in_flight(seq):
            self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
        self.outputs.abort(out)
        chunk = self.outputs.take_chunk(out)
        now = time.time()
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        self.counters.finished_requests += 1
        self._notify(StepStats(
            num_running=len(self.running), num_waiting=len(self.waiting), batch_size=0, num_decode_tokens=0,
            num_prefill_tokens=0, num_preempted=0, kv_usage=self.kv.usage, step_time=0.0,
            finished=[FinishedRequest(request_id, "abort", seq.num_prompt_tokens, len(seq.output_ids),
                                      now - seq.arrival_time, ttft)]))
        return chunk

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._in_flight is not None)

    def _build_decode_graph(self) -> None:
        """Compile and warm up the decode graph on a scratch sequence's slot."""
        from xllm.core.graph_runner import CompiledDecode

        if not self.kv.slot_addressed:
            log.warning("compiled decode graphs need slot-addressed KV (xtensor/contiguous); staying eager")
            return
        native = self.runner.native_decode and getattr(self.model, "_fused", None) is not None
        low = 9 if native else 1
        if low > self.config.max_num_seqs:
            return
        graph = CompiledDecode(self.model, self.kv, low, self.config.max_num_seqs)
        scratch = Sequence("__graph_warmup__", [0], SamplingParams(max_tokens=1), 0.0)
        if not self.kv.admit(scratch, 1):
            raise RuntimeError("no KV memory for the graph warm-up")
        try:
            graph.warmup(scratch.slot)
        finally:
            self.kv.free(scratch)
        self.runner.graph = graph

    # ---- the step -------------------------------------------------------
    def step(self) -> list[engine_pb2.GenerateResponse]:
        """Run one iteration and return the stream chunks it produced.

        Synchronous: schedule, forward, sample, emit. With ``async_scheduling``
        the forward of step k runs on a worker thread while this thread
        schedules and prepares step k+1 (with placeholder tokens for step k's
        outputs, swapped in when they land) and then detokenizes and emits step
        k's outputs during step k+1's forward; chunks therefore trail by one step.
        """
        if self.config.async_scheduling:
            return self._step_overlapped()
        plan = self._schedule(self.running)
        if not plan:
            return []
        flight = self._prepare(plan)
        flight.start(None)
        self._swap_in(flight)
        return self._emit(flight)

    def _step_overlapped(self) -> list[engine_pb2.GenerateResponse]:
        responses: list[engine_pb2.GenerateResponse] = []
        prev = self._in_flight
        if prev is not None and self._kv_tight():
            # preemption must never free pages an in-flight forward writes: land it first
            self._in_flight = None
            self._swap_in(prev)
            responses += self._emit(prev)
            prev = None
        busy = prev.sampled_seqs if prev is not None else set()
        # sequences whose in-flight token is their last one are not scheduled again
        ready = [s for s in self.running if not (s in busy and self._saturated(s))]
        parked = [s for s in self.running if s in busy and self._saturated(s)]
        plan = self._schedule(ready)
        self.running = ready + parked
        flight = self._prepare(plan) if plan else None
        if prev is not None:
            self._swap_in(prev)
        if flight is not None:
            flight.patch_placeholders()
            flight.start(self._worker)
        self._in_flight = flight
        if prev is not None:
            responses += self._emit(prev)  # overlaps the forward just started
        return responses

    def _schedule(self, running: list[Sequence]) -> StepPlan:
        plan = self.policy.schedule(running, self.waiting, self.kv)
        for seq in plan.preempted:
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.WAITING
            seq.num_preemptions += 1
        for seq in plan.admitted:
            seq.status = SeqStatus.RUNNING
        self.counters.num_preemptions += len(plan.preempted)
        return plan

    def _prepare(self, plan: StepPlan) -> StepInFlight:
        """Pack the step's inputs and advance its sequences as if it had run; each
        sequence that samples this step gets a placeholder for its new token."""
        chunks = [(c.seq, c.num_tokens) for c in plan.chunks]
        batch = self.runner.prepare(chunks)
        self.kv.prefetch(batch.sample_seqs)  # map next step's pages while this one computes
        for seq, n in chunks:
            seq.num_computed_tokens += n
        flight = StepInFlight(plan, chunks, batch, self.runner, self.sampler, time.perf_counter())
        for seq in batch.sample_seqs:
            flight.placeholder_at.append(len(seq.output_ids))
            seq.output_ids.append(PLACEHOLDER)
        return flight

    def _swap_in(self, flight: StepInFlight) -> None:
        """Wait for the forward, put the sampled tokens in place of the placeholders."""
        flight.wait()
        for seq, _ in flight.chunks:
            self.kv.on_computed(seq)
        for i, seq in enumerate(flight.batch.sample_seqs):
            seq.output_ids[flight.placeholder_at[i]] = flight.result.token_ids[i]
        for seq in self._free_after_flight.pop(id(flight), []):
            self.kv.free(seq)

    def _emit(self, flight: StepInFlight) -> list[engine_pb2.GenerateResponse]:
        """Detokenize and check stop conditions for a landed step; retire finished requests."""
        responses: list[engine_pb2.GenerateResponse] = []
        now = time.time()
        prompt_tokens = 0
        ttfts: list[float] = []
        itls: list[float] = []
        finished: list[FinishedRequest] = []
        result = flight.result
        for i, seq in enumerate(flight.batch.sample_seqs):
            out = self.requests.get(seq.request_id)
            if out is None or out.seq is not seq or out.finished:
                continue  # aborted, or its end was detected while this token was in flight
            token = result.token_ids[i]
            if seq.first_token_time is None:
                seq.first_token_time = now
                ttfts.append(now - seq.arrival_time)
                prompt_tokens += seq.num_prompt_tokens
            else:
                itls.append(now - seq.last_token_time)
            seq.last_token_time = now
            self.outputs.append_token(out, token, result.logprobs[i])
            responses.append(self.outputs.take_chunk(out))
            if out.finished:
                finished.append(self._retire(out, now))
        self._account(flight.plan, flight.batch, prompt_tokens, ttfts, itls, finished,
                      time.perf_counter() - flight.started)
        return responses

    def _saturated(self, seq: Sequence) -> bool:
        """Whether the token in flight is certainly the sequence's last (length limits)."""
        return len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len

    def _kv_tight(self) -> bool:
        """Could this step's scheduling preempt? (fewer free blocks than it might need)"""
        bs = self.layout.block_size
        return self.kv.num_free_blocks < len(self.running) + -(-self.config.max_num_batched_tokens // bs) + 1

    def _free_later_if_in_flight(self, seq: Sequence) -> bool:
        """Defer freeing ``seq``'s KV while a forward that writes it is in flight."""
        flight = self._in_flight
        if flight is not None and seq in flight.seqs:
            self._free_after_flight.setdefault(id(flight), []).append(seq)
            return True
        return False

    def _retire(self, out: RequestOutput, now: float) -> FinishedRequest:
        seq = out.seq
        self.running.remove(seq)
        if not self._free_later_if_in_flight(seq):
            self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
        del self.requests[seq.request_id]
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        return FinishedRequest(seq.request_id, _REASON_NAMES.get(out.finish_reason, "stop"), seq.num_prompt_tokens,
                               len(seq.output_ids), now - seq.arrival_time, ttft)

    def _account(self, plan, batch, prompt_tokens, ttfts, itls, finished, step_time) -> None:
        c = self.counters
        c.steps += 1
        c.prompt_tokens += prompt_tokens
        c.generation_tokens += len(batch.sample_seqs)
        c.finished_requests += len(finished)
        c.max_batch_size = max(c.max_batch_size, len(plan.chunks))
        if batch.num_decode > 1:
            c.multi_seq_decode_steps += 1
        c.observe_latency(ttfts, itls)
        if not self.observers:
            return
        queries = getattr(self.kv, "prefix_queries", 0)
        hits = getattr(self.kv, "prefix_hits", 0)
        stats = StepStats(
            num_running=len(self.running), num_waiting=len(self.waiting), batch_size=len(plan.chunks),
            num_decode_tokens=batch.num_decode, num_prefill_tokens=plan.num_tokens - batch.num_decode,
            num_preempted=len(plan.preempted), kv_usage=self.kv.usage, step_time=step_time,
            prompt_tokens=prompt_tokens, ttfts=ttfts, inter_token_latencies=itls, finished=finished,
            prefix_cache_queries=queries - self._reported_prefix[0], prefix_cache_hits=hits - self._reported_prefix[1])
        self._reported_prefix = (queries, hits)
        self._notify(stats)

    def _notify(self, stats: StepStats) -> None:
        for obs in self.observers:
            obs.on_step(stats)

    def _enqueue(self, seq: Sequence) -> None:
        """Insert into ``waiting`` in (priority, arrival) order."""
        key = (seq.priority, seq.arrival_time)
        idx = len(self.waiting)
        while idx > 0 and (self.waiting[idx - 1].priority, self.waiting[idx - 1].arrival_time) > key:
            idx -= 1
        self.waiting.insert(idx, seq)

    def drain_kv_events(self) -> list[tuple[bool, int]]:
        """Prefix-cache events (stored?, block hash) since the last call (engine thread only)."""
        return self.kv.drain_events()

    def close(self) -> None:
        """Release the KV memory's OS resources; the engine is unusable afterwards."""
        if self._in_flight is not None:
            self._in_flight.wait()
        if self._owns_worker and self._worker is not None:
            self._worker.shutdown(wait=True)
        self.kv.close()

    # ---- reports ----------------------------------------------------------
    def load_report(self) -> instance_pb2.LoadReport:
        return instance_pb2.LoadReport(
            instance_id=self.instance_id, num_running=len(self.running), num_waiting=len(self.waiting),
            kv_usage=self.kv.usage, kv_free_tokens=self.kv.free_tokens, recent_ttft=self.counters.recent_ttft,
            recent_tpot=self.counters.recent_tpot, timestamp=time.time())
