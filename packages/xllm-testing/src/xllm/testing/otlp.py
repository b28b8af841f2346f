"""A real OTLP trace receiver on loopback for tests: the official ``opentelemetry-proto`` service definitions.

No OpenTelemetry Collector binary installs from the registries this project reaches, so tests receive spans
with :class:`OTLPReceiver`: ``TraceService/Export`` over gRPC (what ``OTLPSpanExporter`` of
``opentelemetry-exporter-otlp-proto-grpc`` calls) and ``POST /v1/traces`` with a protobuf body (the
``-proto-http`` exporter's), both decoded into :class:`ReceivedSpan`. :meth:`OTLPReceiver.wait_for` blocks on
a condition until the spans a test expects arrived (no sleeps).
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as an exporter sent it (ids in hex, times in ns since the epoch)."""

    trace_id: str
    span_id: str
    parent_id: str          # "" for a root
    name: str
    kind: int
    service: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    resource: dict = field(default_factory=dict)
    status_code: int = 0    # 2: error
    status_message: str = ""
    transport: str = "grpc"

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: common_pb2.AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def decode(request: trace_service_pb2.ExportTraceServiceRequest, transport: str) -> list[ReceivedSpan]:
    out = []
    for rs in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(
                    s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, s.kind,
                    str(resource.get("service.name", "")), s.start_time_unix_nano, s.end_time_unix_nano,
                    {kv.key: _value(kv.value) for kv in s.attributes}, resource, s.status.code, s.status.message,
                    transport))
    return out


class OTLPReceiver:
    """Receives OTLP traces on loopback over gRPC (:attr:`grpc_endpoint`) and HTTP (:attr:`http_endpoint`)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        receiver = self

        class _Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver._add(decode(request, "grpc"))
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(), self._grpc)
        port = self._grpc.add_insecure_port(f"{host}:0")
        self._grpc.start()
        self.grpc_endpoint = f"http://{host}:{port}"

        class _Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(decode(request, "http"))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._http = ThreadingHTTPServer((host, 0), _Handler)
        self._http_thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._http_thread.start()
        self.http_endpoint = f"http://{host}:{self._http.server_address[1]}/v1/traces"

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._cond:
            self.spans.extend(spans)
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans received so far once ``predicate`` holds for them (``TimeoutError`` naming what came)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self.spans})
                    raise TimeoutError(f"spans received in {timeout:g} s do not satisfy the test: {names}")
                self._cond.wait(left)
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._cond:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self._grpc.stop(0)
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self) -> OTLPReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
