"""The xllm:kv_tier_* series of an engine's KV tiers, as /metrics renders them."""

from prometheus_client import CollectorRegistry, generate_latest

from xllm.gateway.kv_tier_metrics import KVTierCollector
from xllm.kvstore.tier import TierStats


def test_tier_stats_become_labelled_counters_and_gauges():
    stats = {"host": TierStats(queries=5, hits=3, bytes_read=300, load_seconds=0.25, capacity_bytes=1000),
             "disk": TierStats(queries=2, corrupt=1, errors=4, up=False)}
    registry = CollectorRegistry()
    registry.register(KVTierCollector("m", "e0", lambda: stats))
    text = generate_latest(registry).decode()
    for line in ('xllm:kv_tier_hits_total{instance="e0",model_name="m",tier="host"} 3.0',
                 'xllm:kv_tier_queries_total{instance="e0",model_name="m",tier="disk"} 2.0',
                 'xllm:kv_tier_read_bytes_total{instance="e0",model_name="m",tier="host"} 300.0',
                 'xllm:kv_tier_load_seconds_total{instance="e0",model_name="m",tier="host"} 0.25',
                 'xllm:kv_tier_corrupt_blocks_total{instance="e0",model_name="m",tier="disk"} 1.0',
                 'xllm:kv_tier_up{instance="e0",model_name="m",tier="disk"} 0.0',
                 'xllm:kv_tier_up{instance="e0",model_name="m",tier="host"} 1.0',
                 'xllm:kv_tier_capacity_bytes{instance="e0",model_name="m",tier="host"} 1000.0'):
        assert line in text, line
