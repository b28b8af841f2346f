"""An engine's spans: what one traced request did on this instance, as children of its caller's span.

A caller (the gateway) that traces a request sends its span's W3C context with the ``Generate`` call (gRPC
metadata ``traceparent``; in one process, the in-process client passes it along). :meth:`EngineTracer.begin`
turns it into a :class:`TracedCall` whose :class:`~xllm.core.request_trace.RequestTrace` the engine fills
step by step; :meth:`TracedCall.observe` sees each chunk sent and :meth:`TracedCall.end` writes the spans once
the call is over (the request finished, failed, was handed off or handed back), all with the times the
engine measured:

==========================  ==========================================================================
span                        from .. to, attributes
==========================  ==========================================================================
``engine.request`` (server) the call's arrival .. its end: request id, instance, phase, prompt/cached/
                            output tokens, finish reason, preemptions; error status when it failed
``engine.queue``            arrival .. its first step (a decode side's includes waiting for the KV)
``engine.prefill``          each prefill chunk's forward: tokens, index, recompute
``engine.decode``           first .. last decode step: output tokens, steps, TPOT
``engine.speculation``      the decode span's time, when drafts were verified: steps, drafted, accepted
``kv.transfer``             decode side of a hand-off or migration: bytes, tokens, transport, outcome
``kv.handoff``              prefill side (or a migration's source): the first token .. handed off
==========================  ==========================================================================

Requests without a (sampled) context cost one dictionary lookup in the metadata. Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from xllm.core.request_trace import RequestTrace
from xllm.engine_api.tracing import Tracing, end_span
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.enums import finish_reason_name

HANDED_OFF = engine_pb2.FINISH_REASON_HANDED_OFF
_PHASES = {engine_pb2.DISAGG_PHASE_NONE: "whole", engine_pb2.DISAGG_PHASE_PREFILL: "prefill",
           engine_pb2.DISAGG_PHASE_DECODE: "decode"}


class EngineTracer:
    """Makes the :class:`TracedCall` of each traced request of one instance (see the module docstring)."""

    def __init__(self, tracing: Tracing, instance_id: str) -> None:
        self.tracing = tracing
        self.instance_id = instance_id

    def begin(self, carrier: Iterable[tuple[str, str]] | dict[str, str] | None,
              request: engine_pb2.GenerateRequest) -> TracedCall | None:
        """The traced call of ``request`` when ``carrier`` (gRPC metadata or headers) holds a sampled span
        context and tracing is on; else None."""
        if not self.tracing.enabled or not carrier:
            return None
        ctx = self.tracing.context_of(carrier)
        if ctx is None:
            return None
        return TracedCall(self, ctx, request)


@dataclass
class TracedCall:
    """One traced ``Generate`` call: the engine's record, what was streamed, and its spans at the end."""

    tracer: EngineTracer
    context: object
    request: engine_pb2.GenerateRequest
    record: RequestTrace = field(default_factory=RequestTrace)
    output_tokens: int = 0
    first_chunk: float | None = None
    finish: str = ""
    usage: engine_pb2.Usage | None = None
    transfer: tuple[float, engine_pb2.DisaggStats] | None = None  # (seen at, stats) of a decode side's hand-off
    handed_off: float | None = None
    ended: bool = False

    def observe(self, chunk: engine_pb2.GenerateResponse) -> None:
        """A chunk sent to the caller."""
        now = time.time()
        if chunk.token_ids and self.first_chunk is None:
            self.first_chunk = now
        self.output_tokens += len(chunk.token_ids)
        if chunk.HasField("disagg_stats") and (chunk.disagg_stats.transport or chunk.disagg_stats.recomputed):
            self.transfer = (now, chunk.disagg_stats)
        if chunk.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
            self.finish = finish_reason_name(chunk.finish_reason) or ""
            self.usage = chunk.usage
            if chunk.finish_reason == HANDED_OFF:
                self.handed_off = now

    def end(self, error: str | None = None) -> None:
        """Write the call's spans (once); ``error``: why it failed (the root span's error status)."""
        if self.ended:
            return
        self.ended = True
        t, rec, req, now = self.tracer.tracing, self.record, self.request, time.time()
        usage = self.usage
        attrs = {"xllm.request_id": req.request_id, "xllm.instance_id": self.tracer.instance_id,
                 "xllm.phase": _PHASES.get(req.disagg_phase, "whole"), "gen_ai.request.model": req.model,
                 "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
                 "gen_ai.usage.output_tokens": self.output_tokens,
                 "xllm.cached_prompt_tokens": rec.cached_prompt_tokens,
                 "xllm.preemptions": rec.preemptions, "xllm.resumed_output_tokens": req.resumed_output_tokens}
        if self.finish:
            attrs["gen_ai.response.finish_reasons"] = (self.finish,)
        if usage is not None and usage.cached_prompt_tokens:
            attrs["xllm.cached_prompt_tokens"] = usage.cached_prompt_tokens
        root = t.start("engine.request", self.context, "server", attrs, rec.arrival)
        queued_until = rec.first_scheduled or self.first_chunk or now
        end_span(t.start("engine.queue", root, attributes={"xllm.waiting_for_kv": req.disagg_phase ==
                                                            engine_pb2.DISAGG_PHASE_DECODE}, start_time=rec.arrival),
                 queued_until)
        for i, c in enumerate(rec.chunks):
            end_span(t.start("engine.prefill", root, attributes={"xllm.chunk.index": i, "xllm.chunk.tokens": c.tokens,
                                                                 "xllm.chunk.recompute": c.recompute},
                             start_time=c.start), c.end)
        if self.transfer is not None:
            self._transfer_span(root, *self.transfer)
        if rec.decode_start is not None:
            self._decode_spans(root, rec)
        if self.handed_off is not None:
            end_span(t.start("kv.handoff", root, attributes={"xllm.handoff.outcome": "handed_off"},
                             start_time=self.first_chunk or rec.decode_end or self.handed_off), self.handed_off)
        end_span(root, now, error)

    def _transfer_span(self, root, seen: float, stats: engine_pb2.DisaggStats) -> None:
        outcome = "recomputed" if stats.recomputed else "ok"
        attrs = {"xllm.kv.transport": stats.transport, "xllm.kv.bytes": stats.transfer_bytes,
                 "xllm.kv.tokens": stats.transferred_tokens, "xllm.kv.outcome": outcome,
                 "xllm.kv.overlapped_s": stats.overlapped_seconds, "xllm.kv.store_blocks": stats.store_blocks}
        if stats.failure:
            attrs["xllm.kv.failure"] = stats.failure
        t = self.tracer.tracing
        end_span(t.start("kv.transfer", root, attributes=attrs, start_time=seen - stats.transfer_seconds), seen,
                 stats.failure or None)

    def _decode_spans(self, root, rec: RequestTrace) -> None:
        t = self.tracer.tracing
        seconds = max(rec.decode_end - rec.decode_start, 0.0)
        tokens = max(self.output_tokens - (1 if rec.chunks else 0), 1)  # (a prefill's step sampled the first)
        decode = t.start("engine.decode", root, attributes={
            "xllm.decode.steps": rec.decode_steps, "xllm.decode.tokens": self.output_tokens,
            "xllm.decode.tpot_s": seconds / tokens}, start_time=rec.decode_start)
        if rec.spec_steps:
            end_span(t.start("engine.speculation", decode, attributes={
                "xllm.spec.steps": rec.spec_steps, "xllm.spec.drafted": rec.spec_drafted,
                "xllm.spec.accepted": rec.spec_accepted,
                "xllm.spec.acceptance": rec.spec_accepted / rec.spec_drafted if rec.spec_drafted else 0.0},
                start_time=rec.decode_start), rec.decode_end)
        end_span(decode, rec.decode_end)


async def traced_stream(call: TracedCall, stream: AsyncIterator[engine_pb2.GenerateResponse]
                        ) -> AsyncIterator[engine_pb2.GenerateResponse]:
    """``stream``'s chunks, each observed by ``call``, whose spans are written when it ends (the in-process
    client's requests; the gRPC service observes its calls itself)."""
    error = None
    try:
        async for chunk in stream:
            call.observe(chunk)
            yield chunk
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        call.end(error if error or call.finish else "abandoned by the caller")
