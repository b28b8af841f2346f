"""Prometheus metrics with vLLM's metric names under the ``xllm:`` prefix.

Each app owns its :class:`~prometheus_client.CollectorRegistry` (no global
state). :class:`EngineMetrics` is a :class:`~xllm.core.StatsObserver`: the
engine thread calls ``on_step`` after every step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from xllm.core.stats import StepStats
from xllm.proto.registry.v1 import instance_pb2

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class EngineMetrics:
    """Metrics of one or more engine instances, labelled by model and instance."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name", "instance"]
        self.running = Gauge("xllm:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("xllm:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        self.kv_usage = Gauge("xllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", labels,
                              registry=r)
        self.prompt_tokens = Counter("xllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("xllm:generation_tokens", "Tokens generated.", labels, registry=r)
        self.prefix_queries = Counter("xllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels, registry=r)
        self.prefix_hits = Counter("xllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels,
                                   registry=r)
        self.preemptions = Counter("xllm:num_preemptions", "Sequences preempted for KV memory.", labels, registry=r)
        self.request_success = Counter("xllm:request_success", "Finished requests by finish reason.",
                                       [*labels, "finished_reason"], registry=r)
        self.ttft = Histogram("xllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("xllm:inter_token_latency_seconds", "Time between consecutive output tokens.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("xllm:e2e_request_latency_seconds", "Request latency from arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("xllm:iteration_tokens_total", "Tokens computed per engine step.", labels,
                                          buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), registry=r)
        self.batch_size = Histogram("xllm:step_batch_size", "Sequences per engine step.", labels,
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.decode_batch_size = Histogram("xllm:decode_batch_size", "Decoding sequences per engine step.", labels,
                                           buckets=_BATCH_BUCKETS, registry=r)

    def observer(self, model_name: str, instance: str) -> _InstanceObserver:
        """A StatsObserver that records one instance's steps."""
        return _InstanceObserver(self, model_name, instance)

    def set_load(self, model_name: str, instance: str, report: instance_pb2.LoadReport) -> None:
        """Refresh the gauges from an instance's live load report (done at scrape time).

        The per-step observer alone leaves them stale whenever the engine goes idle
        without a step, e.g. after the last running request was aborted.
        """
        lb = (model_name, instance)
        self.running.labels(*lb).set(report.num_running)
        self.waiting.labels(*lb).set(report.num_waiting)
        self.kv_usage.labels(*lb).set(report.kv_usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _InstanceObserver:
    def __init__(self, m: EngineMetrics, model_name: str, instance: str) -> None:
        self.m = m
        self.labels = (model_name, instance)

    def on_step(self, s: StepStats) -> None:
        m, lb = self.m, self.labels
        m.running.labels(*lb).set(s.num_running)
        m.waiting.labels(*lb).set(s.num_waiting)
        m.kv_usage.labels(*lb).set(s.kv_usage)
        if s.batch_size:  # a step that ran a forward (aborts report outside steps)
            m.iteration_tokens.labels(*lb).observe(s.num_decode_tokens + s.num_prefill_tokens)
            m.batch_size.labels(*lb).observe(s.batch_size)
        if s.num_decode_tokens:
            m.decode_batch_size.labels(*lb).observe(s.num_decode_tokens)
        if s.num_preempted:
            m.preemptions.labels(*lb).inc(s.num_preempted)
        gen = len(s.ttfts) + len(s.inter_token_latencies)
        if gen:
            m.generation_tokens.labels(*lb).inc(gen)
        for v in s.ttfts:
            m.ttft.labels(*lb).observe(v)
        for v in s.inter_token_latencies:
            m.itl.labels(*lb).observe(v)
        for f in s.finished:
            m.request_success.labels(*lb, f.finish_reason).inc()
            m.e2e.labels(*lb).observe(f.e2e_latency)
        if s.prompt_tokens:
            m.prompt_tokens.labels(*lb).inc(s.prompt_tokens)
        if s.prefix_cache_queries:
            m.prefix_queries.labels(*lb).inc(s.prefix_cache_queries)
            m.prefix_hits.labels(*lb).inc(s.prefix_cache_hits)
