"""``xllm:kv_tier_*`` metrics: the KV tiers below an engine's KV memory (xllm.core.kv.lower_tiers),
read at scrape time from the in-process engine or, in cluster mode, from each instance's last
heartbeat; one series per (model, instance, tier)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from xllm.gateway.registry.base import Registry
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


TierReadings = Iterable[tuple[str, str, dict[str, TierStats]]]  # (model, instance, tier -> stats)


class KVTierCollector(Collector):
    """Collects ``read()`` — per engine instance its model, id and lower tiers' :class:`TierStats` — at
    each scrape: the in-process engine's tiers (embedded mode), or what each instance's last heartbeat
    reported (cluster mode, :func:`from_registry`)."""

    def __init__(self, read: Callable[[], TierReadings]) -> None:
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        readings = list(self.read())
        for name, kind, doc, field in TIER_METRICS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name, doc, labels=["model_name", "instance", "tier"])
            for model, instance, stats in readings:
                for tier, s in stats.items():
                    family.add_metric([model, instance, tier], float(getattr(s, field)))
            yield family


def from_registry(registry: Registry) -> Callable[[], TierReadings]:
    """The tiers every live instance of ``registry`` reported in its last heartbeat."""
    def read() -> TierReadings:
        return [(s.model, s.instance_id, {t.tier: TierStats.from_proto(t) for t in s.kv_tiers})
                for s in registry.states() if s.kv_tiers]
    return read
