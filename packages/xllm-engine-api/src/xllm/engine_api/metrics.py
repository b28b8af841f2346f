"""The distributions an engine measures step by step, as Prometheus histograms (vLLM's names under the
``xllm:`` prefix): time to first token, inter-token latency and end-to-end latency as the engine saw them,
tokens and sequences per step, the step-time model's error, and finished requests by reason.

Heartbeats carry an instance's counters and load to the gateways, not distributions, so these series have
one source each: the gateway's ``/metrics`` for engines in its own process (embedded mode,
``xllm.gateway.metrics.EngineMetrics``), the engine's own ``/metrics`` (``xllm engine --metrics-port``)
in a cluster. Nothing is exported twice, so sums over a scrape of gateways and engines stay true.
Torch-free: the gateway and the engine process both import it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from xllm.engine_api.stats import StepStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
LABELS = ("model_name", "instance")


class StepHistograms:
    """The step-measured series of one or more instances (labels ``model_name``, ``instance``) on
    ``registry``; :meth:`observe` records one step's :class:`~xllm.engine_api.stats.StepStats`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r, labels = registry, list(LABELS)
        self.request_success = Counter("xllm:request_success", "Finished requests by finish reason.",
                                       [*labels, "finished_reason"], registry=r)
        self.ttft = Histogram("xllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("xllm:inter_token_latency_seconds", "Time between consecutive output tokens.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("xllm:e2e_request_latency_seconds", "Request latency from arrival to finish.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("xllm:iteration_tokens_total", "Tokens computed per engine step.", labels,
                                          buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), registry=r)
        self.batch_size = Histogram("xllm:step_batch_size", "Sequences per engine step.", labels,
                                    buckets=BATCH_BUCKETS, registry=r)
        self.decode_batch_size = Histogram("xllm:decode_batch_size", "Decoding sequences per engine step.", labels,
                                           buckets=BATCH_BUCKETS, registry=r)
        self.step_prediction_error = Histogram(
            "xllm:step_time_prediction_error", "Relative error |predicted - measured| / measured of the engine's "
            "step-time prediction, per step (see xllm.core.step_timing).", labels,
            buckets=ERROR_BUCKETS, registry=r)
        # expert parallelism (xllm.core.eplb): one update per closed load window
        self.expert_imbalance = Gauge(
            "xllm:moe_expert_load_imbalance", "Max / mean of the tokens each rank's routed experts computed over "
            "the last load window (mean over MoE layers; 1 is even).", labels, registry=r)
        self.expert_tokens = Counter("xllm:moe_expert_tokens", "Tokens routed to each logical expert (summed over "
                                     "MoE layers).", [*labels, "expert"], registry=r)
        self.eplb_rebalances = Gauge("xllm:eplb_rebalances", "Expert placement switches completed (EPLB).", labels,
                                     registry=r)

    def observe(self, model_name: str, instance: str, s: StepStats) -> None:
        """Record step ``s`` of ``instance`` (engine thread)."""
        lb = (model_name, instance)
        if s.batch_size:  # a step that ran a forward (aborts report outside steps)
            self.iteration_tokens.labels(*lb).observe(s.num_decode_tokens + s.num_prefill_tokens)
            self.batch_size.labels(*lb).observe(s.batch_size)
        if s.num_decode_tokens:
            self.decode_batch_size.labels(*lb).observe(s.num_decode_tokens)
        if s.step_time_prediction_error is not None:
            self.step_prediction_error.labels(*lb).observe(s.step_time_prediction_error)
        if s.ttfts:
            ttft = self.ttft.labels(*lb)
            for v in s.ttfts:
                ttft.observe(v)
        if s.inter_token_latencies:  # one per decoding sequence a step: the series looked up once
            itl = self.itl.labels(*lb)
            for v in s.inter_token_latencies:
                itl.observe(v)
        if s.experts is not None:
            self.expert_imbalance.labels(*lb).set(s.experts.imbalance)
            self.eplb_rebalances.labels(*lb).set(s.experts.rebalances)
            for e, n in enumerate(s.experts.tokens):
                if n:
                    self.expert_tokens.labels(*lb, str(e)).inc(n)
        for f in s.finished:
            self.request_success.labels(*lb, f.finish_reason).inc()
            self.e2e.labels(*lb).observe(f.e2e_latency)


@dataclass
class StepObserver:
    """A :class:`~xllm.engine_api.stats.StatsObserver` recording one instance's steps into ``histograms``."""

    histograms: StepHistograms
    model_name: str
    instance: str

    def on_step(self, s: StepStats) -> None:
        self.histograms.observe(self.model_name, self.instance, s)


class MetricsEndpoint:
    """An engine process's own ``/metrics`` (``xllm engine --metrics-port``): :class:`StepHistograms` of its
    instance over HTTP on ``host:port`` (0: a free port, in :attr:`port`), served on a thread of its own
    until :meth:`close`. The engine's counters and load are not here: its heartbeats bring them to the
    gateways' ``/metrics`` (module docstring).

    Always Prometheus' text format 0.0.4, as the gateway's ``/metrics``: ``prometheus_client``'s own
    server answers a scraper asking for OpenMetrics with the names' colons escaped (``xllm_...``), which
    would split every series in two names between the gateway and the engines."""

    def __init__(self, model_name: str, instance: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.registry = CollectorRegistry()
        self.observer = StepObserver(StepHistograms(self.registry), model_name, instance)
        self._server = ThreadingHTTPServer((host, port), _handler(self.registry))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="xllm-metrics", daemon=True)
        self._thread.start()
        self.host = host
        self.port: int = self._server.server_port
        self._closed = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if not self._closed.is_set():
            self._closed.set()
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)


def _handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    """``GET /metrics``: ``registry`` in the text format; anything else 404."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # scrapes every few seconds: not logged
            pass

    return Handler
