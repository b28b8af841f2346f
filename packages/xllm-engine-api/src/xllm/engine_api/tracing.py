"""Request traces with OpenTelemetry: one process's tracer, its flags, and the W3C context between processes.

Off by default. ``--otlp-traces-endpoint URL`` turns it on for a gateway or an engine: spans go to an
OTLP receiver (an OpenTelemetry Collector, Jaeger, Tempo) over gRPC or HTTP/protobuf
(``--otlp-traces-protocol``, default ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` /
``$OTEL_EXPORTER_OTLP_PROTOCOL`` / grpc), batched on the SDK's exporter thread. The exporters read the
standard ``OTEL_EXPORTER_OTLP_*`` variables themselves (headers, certificates, compression, timeouts), the
resource ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``, the batch processor ``OTEL_BSP_*``.

Who starts a trace: the gateway, for each HTTP generation request (continuing the client's
``traceparent`` header when it sends one), sampled by ``--otlp-traces-sample-ratio`` (default
``$OTEL_TRACES_SAMPLER_ARG`` or 1) unless the client's context already decided. An engine never starts
one: it continues the context its caller sends as gRPC metadata (``traceparent``/``tracestate``, a
:data:`TraceCarrier`) and records nothing for a request that carries none.

When off, :class:`Tracing` is a null object: no OpenTelemetry module is imported, :meth:`Tracing.start_root`
returns None and callers skip their spans; what that leaves on a request's path is measured in
``docs/performance.md``. Each process builds its own :class:`Tracing` (its own tracer provider: no global
provider or propagator is installed) and shuts it down on exit, flushing what is queued.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

TraceCarrier = dict[str, str]  # the W3C trace context headers of a span: traceparent (+ tracestate)
PROTOCOLS = ("grpc", "http/protobuf")
TRACE_HEADERS = ("traceparent", "tracestate")


def _ratio(text: str) -> float:
    """A sampling ratio in [0, 1] (0: only the traces a client's sampled ``traceparent`` asks for)."""
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def _default_protocol() -> str:
    value = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    return value if value in PROTOCOLS else "grpc"


def _default_ratio() -> float:
    try:
        return min(max(float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1")), 0.0), 1.0)
    except ValueError:
        return 1.0


@dataclass(frozen=True)
class TracingOptions:
    """Where a process sends its spans (``endpoint`` None: tracing off)."""

    endpoint: str | None = None
    protocol: str = "grpc"             # "grpc" | "http/protobuf"
    sample_ratio: float = 1.0          # of the traces this process starts (the gateway's requests)
    service_name: str = "xllm"

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"--otlp-traces-protocol: {self.protocol!r} is not one of {', '.join(PROTOCOLS)}")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)

    def as_args(self) -> list[str]:
        """These options as the flags of :func:`add_tracing_flags` (for a spawned engine process)."""
        if not self.enabled:
            return []
        return ["--otlp-traces-endpoint", str(self.endpoint), "--otlp-traces-protocol", self.protocol,
                "--otlp-traces-sample-ratio", repr(self.sample_ratio)]


def add_tracing_flags(p: argparse.ArgumentParser) -> None:
    """``--otlp-traces-*`` (see the module docstring), the same on ``xllm serve`` and ``xllm engine``."""
    g = p.add_argument_group("tracing", "OpenTelemetry request traces (off unless an endpoint is given)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send request traces to this OTLP receiver (an OpenTelemetry Collector, Jaeger, Tempo): "
                        "e.g. http://127.0.0.1:4317 for OTLP/gRPC or http://127.0.0.1:4318/v1/traces for "
                        "OTLP/HTTP; the standard OTEL_EXPORTER_OTLP_* variables (headers, certificates, "
                        "compression, timeouts) and OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES apply")
    g.add_argument("--otlp-traces-protocol", default=_default_protocol(), choices=PROTOCOLS,
                   help="OTLP transport (default: $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or "
                        "$OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)")
    g.add_argument("--otlp-traces-sample-ratio", type=_ratio, default=_default_ratio(), metavar="R",
                   help="share of requests traced, decided by the gateway per request (a client's sampled "
                        "traceparent is always followed); engines follow their caller (default: "
                        "$OTEL_TRACES_SAMPLER_ARG or 1)")


def tracing_options(args: argparse.Namespace, service_name: str) -> TracingOptions:
    return TracingOptions(args.otlp_traces_endpoint, args.otlp_traces_protocol, args.otlp_traces_sample_ratio,
                          os.environ.get("OTEL_SERVICE_NAME") or service_name)


class Tracing:
    """One process's tracer (a null object when ``options`` is off).

    ``attributes``: resource attributes of every span of this process (e.g. ``xllm.instance_id``).
    ``processors``: extra span processors (the gateway keeps its recent requests' spans for its page).
    ``roots``: whether this process starts traces (a gateway) or only continues its callers' (an engine).
    """

    def __init__(self, options: TracingOptions | None = None, attributes: Mapping[str, Any] | None = None,
                 processors: Sequence[Any] = (), roots: bool = True) -> None:
        self.options = options or TracingOptions()
        self.enabled = self.options.enabled or bool(processors)
        self._provider = None
        self.tracer = None
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        root = TraceIdRatioBased(self.options.sample_ratio) if roots else ALWAYS_OFF
        resource = Resource.create({"service.name": self.options.service_name, "process.pid": os.getpid(),
                                    **(attributes or {})})
        self._provider = TracerProvider(resource=resource, sampler=ParentBased(root))
        if self.options.enabled:
            self._provider.add_span_processor(BatchSpanProcessor(_exporter(self.options)))
        for p in processors:
            self._provider.add_span_processor(p)
        self.tracer = self._provider.get_tracer("xllm")
        self._propagator = TraceContextTextMapPropagator()
        log.info("tracing on: %s spans to %s (%s), sample ratio %g", self.options.service_name,
                 self.options.endpoint or "this process only", self.options.protocol, self.options.sample_ratio)

    def context_of(self, carrier: Mapping[str, str] | Iterable[tuple[str, str]]):
        """The OpenTelemetry context a caller sent (headers or gRPC metadata pairs); None when off or
        when the carrier holds no sampled span."""
        if not self.enabled:
            return None
        items = carrier.items() if isinstance(carrier, Mapping) else carrier
        found = {k.lower(): v for k, v in items if k.lower() in TRACE_HEADERS}
        if "traceparent" not in found:
            return None
        return self._propagator.extract(found)

    def carrier(self, span) -> TraceCarrier:
        """The W3C headers that make ``span`` the parent of the receiver's spans (empty: not sampled)."""
        if span is None or not span.get_span_context().trace_flags.sampled:
            return {}
        from opentelemetry import trace

        out: TraceCarrier = {}
        self._propagator.inject(out, context=trace.set_span_in_context(span))
        return out

    def start(self, name: str, parent=None, kind: str = "internal", attributes: Mapping[str, Any] | None = None,
              start_time: float | None = None):
        """A span under ``parent`` (a span or a context; None: a new trace), started at ``start_time`` (wall
        seconds; default now). None when off. The caller ends it (``end_span``)."""
        if not self.enabled:
            return None
        from opentelemetry import trace

        ctx = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
        return self.tracer.start_span(name, context=ctx, kind=_KINDS[kind](), attributes=attributes,
                                      start_time=None if start_time is None else int(start_time * 1e9))

    def shutdown(self) -> None:
        """Flush the queued spans and stop the exporter (at process exit)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self._provider is None or self._provider.force_flush(int(timeout_s * 1000))


def end_span(span, end_time: float | None = None, error: str | None = None) -> None:
    """End ``span`` (None: nothing) at ``end_time`` (wall seconds; default now), with an error status
    naming ``error``."""
    if span is None:
        return
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(None if end_time is None else int(end_time * 1e9))


def _kind(name: str):
    def get():
        from opentelemetry.trace import SpanKind

        return getattr(SpanKind, name)
    return get


_KINDS = {k: _kind(k.upper()) for k in ("internal", "server", "client")}


def _exporter(options: TracingOptions):
    if options.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = options.endpoint
        insecure = endpoint.startswith("http://") or None  # https:// (or no scheme + the env's choice): TLS
        return OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

    endpoint = options.endpoint if options.endpoint.rstrip("/").endswith("/v1/traces") \
        else options.endpoint.rstrip("/") + "/v1/traces"
    return HTTPExporter(endpoint=endpoint)
