"""The gateway's spans of a request: one trace from the HTTP request to every instance it ran on.

:class:`TraceMiddleware` (installed only when tracing is on) starts the root span of each generation
request (``POST /v1/...``; continuing the client's W3C ``traceparent`` header) and ends it when the
response, a whole stream included, has been sent. The serving code and the dispatcher add its children
through the request's :class:`RequestSpans` (:func:`spans_of`; :data:`NO_SPANS`, whose methods do nothing,
when the request is not traced):

=====================  =================================================================================
span                   attributes
=====================  =================================================================================
``POST /v1/...``       (server) method, route, status, request id, model, stream, n, output tokens, TTFT
``validate``           the body read, parsed and checked against the limits
``tokenize``           the chat template and the tokenizer: prompt tokens
``route``              policy reason, candidates, scores, chosen instance(s), matched tokens, PD pair
``engine.generate``    (client) one instance's part: instance, role, phase, engine request ids; the
                       instance's own spans (:mod:`xllm.engine.tracing`) are its children
``resume``             a broken stream resumed elsewhere: cause, mode (recompute), from, to, tokens so far
``move``               a request moved off a draining or flipping instance: mode (migrated, recomputed), from, to
=====================  =================================================================================

The W3C context of each ``engine.generate`` span goes to its instance with the call
(:meth:`RequestSpans.engine_call`). :class:`RecentTraces` keeps the gateway's spans of the last requests
for the cluster page.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from xllm.engine_api.logs import TRACE_ID
from xllm.engine_api.tracing import TraceCarrier, Tracing, TracingOptions, end_span

if TYPE_CHECKING:
    from xllm.gateway.router import Ticket

TRACED_PREFIX = "/v1/"
SPANS_KEY = "spans"


class RequestSpans:
    """The spans of one traced request (see the module docstring); every method is safe to call in any order."""

    def __init__(self, tracing: Tracing | None = None, root=None) -> None:
        self.tracing = tracing
        self.root = root
        self.recording = root is not None
        self._calls: dict[int, list] = {}  # id(ticket) -> [span, open requests]

    @contextlib.contextmanager
    def phase(self, name: str, **attributes: Any) -> Iterator[Any]:
        """A child span around the ``with`` block (None inside when not recording); an exception marks it failed."""
        if not self.recording:
            yield None
            return
        span = self.tracing.start(name, self.root, attributes=attributes)
        try:
            yield span
        except BaseException as exc:
            end_span(span, error=f"{type(exc).__name__}: {exc}")
            raise
        end_span(span)

    def set(self, **attributes: Any) -> None:
        """Attributes of the root span."""
        if self.recording:
            self.root.set_attributes(attributes)

    def first_token(self, seconds: float) -> None:
        """The request's first token reached the client ``seconds`` after its dispatch (kept once)."""
        if self.recording and "xllm.ttft_s" not in (self.root.attributes or {}):
            self.root.set_attribute("xllm.ttft_s", seconds)

    def finished(self, reason: str, output_tokens: int, seconds: float) -> None:
        """One choice ended with ``reason`` after ``output_tokens`` tokens, ``seconds`` after its dispatch."""
        if not self.recording:
            return
        attrs = self.root.attributes or {}
        tokens = attrs.get("gen_ai.usage.output_tokens", 0) + output_tokens
        self.root.set_attributes({"gen_ai.usage.output_tokens": tokens,
                                  "gen_ai.response.finish_reasons": (*attrs.get("gen_ai.response.finish_reasons", ()),
                                                                     reason)})
        ttft = attrs.get("xllm.ttft_s")
        if ttft is not None and output_tokens > 1:
            self.root.set_attribute("xllm.tpot_s", (seconds - ttft) / (output_tokens - 1))

    def routed(self, span, ticket: Ticket, prefill: Ticket | None = None) -> None:
        """What the router decided (on the ``route`` span from :meth:`phase`): the chosen instance, why, the
        candidates' scores; for a PD pair both instances."""
        if span is None:
            return
        d = ticket.decision
        attrs = {"xllm.route.instance": ticket.state.instance_id, "xllm.route.reason": d.reason,
                 "xllm.route.prompt_tokens": ticket.num_prompt_tokens,
                 "xllm.route.matched_tokens": ticket.matched_tokens,
                 "xllm.route.predicted_latency_s": d.predicted_latency}
        if d.scores:
            attrs["xllm.route.candidates"] = tuple(d.scores)
            attrs["xllm.route.scores"] = tuple(float(v) for v in d.scores.values())
        if prefill is not None and prefill is not ticket:
            attrs["xllm.route.prefill_instance"] = prefill.state.instance_id
            attrs["xllm.route.prefill_reason"] = prefill.decision.reason
            attrs["xllm.route.decode_instance"] = ticket.state.instance_id
        span.set_attributes(attrs)

    def engine_call(self, ticket: Ticket, phase: str, request_id: str) -> TraceCarrier | None:
        """The context to send with a call on ``ticket``'s instance: its ``engine.generate`` span (one per
        ticket, started by the first call; each call is one open request until :meth:`left`)."""
        if not self.recording:
            return None
        key = id(ticket)
        entry = self._calls.get(key)
        if entry is None:
            span = self.tracing.start("engine.generate", self.root, "client", {
                "xllm.instance_id": ticket.state.instance_id, "xllm.role": ticket.state.role, "xllm.phase": phase,
                "xllm.request_ids": (request_id,)})
            entry = self._calls[key] = [span, 0]
        else:
            ids = entry[0].attributes.get("xllm.request_ids", ())
            entry[0].set_attribute("xllm.request_ids", (*ids, request_id))
        entry[1] += 1
        return self.tracing.carrier(entry[0])

    def left(self, ticket: Ticket, error: str | None = None, how: str | None = None) -> None:
        """One request left ``ticket``'s instance (finished, failed, moved); its span ends with the last."""
        entry = self._calls.get(id(ticket))
        if entry is None:
            return
        entry[1] -= 1
        if how:
            entry[0].set_attribute("xllm.left", how)
        if error:
            entry[0].set_attribute("xllm.error", error)
        if entry[1] <= 0:
            del self._calls[id(ticket)]
            end_span(entry[0], error=error)

    def step(self, name: str, start: float, **attributes: Any) -> None:
        """A finished child span that began at ``start`` (wall seconds) and ends now (a resume, a move)."""
        if self.recording:
            end_span(self.tracing.start(name, self.root, attributes=attributes, start_time=start))

    def end(self, status: int, error: str | None = None) -> None:
        """The root span's end (the response sent); open instance spans end with it."""
        if not self.recording:
            return
        for span, _ in list(self._calls.values()):
            end_span(span, error=error)
        self._calls.clear()
        self.root.set_attribute("http.response.status_code", status)
        end_span(self.root, error=error or (f"HTTP {status}" if status >= 500 else None))
        self.recording = False


NO_SPANS = RequestSpans()


def spans_of(scope: Scope) -> RequestSpans:
    """The spans :class:`TraceMiddleware` started for this request (:data:`NO_SPANS` when not traced)."""
    return scope.get("state", {}).get(SPANS_KEY, NO_SPANS)


class TraceMiddleware:
    """Starts and ends each generation request's root span (see the module docstring)."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith(TRACED_PREFIX):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        parent = self.tracing.context_of(headers.items())
        path = scope["path"]
        root = self.tracing.start(f"POST {path}", parent, "server", {
            "http.request.method": "POST", "url.path": path, "http.route": path})
        if not root.is_recording():  # not sampled
            root.end()
            await self.app(scope, receive, send)
            return
        spans = RequestSpans(self.tracing, root)
        scope.setdefault("state", {})[SPANS_KEY] = spans
        token = TRACE_ID.set(format(root.get_span_context().trace_id, "032x"))
        status = 500

        async def send_traced(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        error = None
        try:
            await self.app(scope, receive, send_traced)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            TRACE_ID.reset(token)
            request_id = scope.get("state", {}).get("request_id")
            if request_id:
                spans.set(**{"xllm.http_request_id": request_id})
            spans.end(status, error)


class RecentTraces:
    """The gateway's spans of its last ``capacity`` traces (for the cluster page), fed by a span processor
    (:meth:`processor`): :meth:`recent` gives them as plain data, newest first. Thread-safe (spans end on any
    thread)."""

    def __init__(self, capacity: int = 100, max_spans: int = 64) -> None:
        self.capacity = capacity
        self.max_spans = max_spans
        self._lock = threading.Lock()
        self._traces: collections.OrderedDict[int, dict] = collections.OrderedDict()

    def processor(self):
        """An ``opentelemetry.sdk.trace.SpanProcessor`` handing every ended span to :meth:`on_end`."""
        from opentelemetry.sdk.trace import SpanProcessor

        store = self

        class _Keep(SpanProcessor):
            def on_end(self, span) -> None:
                store.on_end(span)

        return _Keep()

    def on_end(self, span) -> None:
        ctx = span.context
        entry = {"name": span.name, "span_id": format(ctx.span_id, "016x"),
                 "parent_id": format(span.parent.span_id, "016x") if span.parent is not None else None,
                 "start_unix": span.start_time / 1e9, "end_unix": span.end_time / 1e9,
                 "attributes": {k: _plain(v) for k, v in (span.attributes or {}).items()},
                 "error": not span.status.is_ok}
        with self._lock:
            trace = self._traces.get(ctx.trace_id)
            if trace is None:
                trace = self._traces[ctx.trace_id] = {"trace_id": format(ctx.trace_id, "032x"), "spans": [],
                                                      "root": None}
                while len(self._traces) > self.capacity:
                    self._traces.popitem(last=False)
            if len(trace["spans"]) < self.max_spans:
                trace["spans"].append(entry)
            if span.kind.name == "SERVER" and span.name.startswith("POST "):
                trace["root"] = entry

    def recent(self, limit: int = 50) -> list[dict]:
        """Newest first: ``{trace_id, request_id, name, start_unix, duration_s, status, spans: [...]}``, each
        span ``{name, span_id, parent_id, start_unix, end_unix, attributes}`` (finished requests only)."""
        with self._lock:
            done = [t for t in reversed(self._traces.values()) if t["root"] is not None][:limit]
            out = []
            for t in done:
                root = t["root"]
                out.append({"trace_id": t["trace_id"], "request_id": root["attributes"].get("xllm.http_request_id"),
                            "name": root["name"], "start_unix": root["start_unix"],
                            "duration_s": root["end_unix"] - root["start_unix"],
                            "status": root["attributes"].get("http.response.status_code", 0),
                            "spans": sorted(t["spans"], key=lambda s: s["start_unix"])})
        return out


def gateway_tracing(options: TracingOptions) -> dict[str, Any]:
    """The gateway's :class:`Tracing` and the :class:`RecentTraces` it feeds (keyword arguments of
    :class:`~xllm.gateway.app.GatewayState`; tracing off: neither)."""
    if not options.enabled:
        return {}
    recent = RecentTraces()
    return {"tracing": Tracing(options, processors=[recent.processor()]), "recent_traces": recent}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value

