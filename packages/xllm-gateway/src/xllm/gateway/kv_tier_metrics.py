"""``xllm:kv_tier_*`` metrics: the KV tiers below an engine's KV memory (xllm.core.kv.lower_tiers),
read from the engine at scrape time, one series per (model, instance, tier)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from xllm.kvstore.tier import TierStats

# (metric name, kind, help, TierStats field); counters get the _total suffix from prometheus_client
TIER_METRICS = (
    ("xllm:kv_tier_queries", "counter", "KV blocks looked up in the tier (after the engine's own KV memory).",
     "queries"),
    ("xllm:kv_tier_hits", "counter", "KV blocks loaded intact from the tier.", "hits"),
    ("xllm:kv_tier_corrupt_blocks", "counter", "KV blocks found in the tier but failing their hash or checksum "
     "check (dropped and recomputed).", "corrupt"),
    ("xllm:kv_tier_read_bytes", "counter", "KV bytes read from the tier.", "bytes_read"),
    ("xllm:kv_tier_written_bytes", "counter", "KV bytes written to the tier.", "bytes_written"),
    ("xllm:kv_tier_load_seconds", "counter", "Time spent reading KV blocks from the tier.", "load_seconds"),
    ("xllm:kv_tier_evictions", "counter", "KV blocks removed from the tier for capacity (LRU).", "evictions"),
    ("xllm:kv_tier_errors", "counter", "Tier operations failed by an I/O or connection error.", "errors"),
    ("xllm:kv_tier_up", "gauge", "1 while the tier is in use, 0 during an outage (the engine runs without it).",
     "up"),
    ("xllm:kv_tier_used_bytes", "gauge", "Bytes the tier holds (all processes sharing it).", "used_bytes"),
    ("xllm:kv_tier_capacity_bytes", "gauge", "The tier's capacity in bytes.", "capacity_bytes"),
)


class KVTierCollector(Collector):
    """Collects ``read()`` (tier name -> :class:`TierStats`) of one engine instance at each scrape."""

    def __init__(self, model_name: str, instance: str, read: Callable[[], dict[str, TierStats]]) -> None:
        self.labels = (model_name, instance)
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.read()
        for name, kind, doc, field in TIER_METRICS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name, doc, labels=["model_name", "instance", "tier"])
            for tier, s in stats.items():
                family.add_metric([*self.labels, tier], float(getattr(s, field)))
            yield family
