"""The xllm:kv_tier_* series of engines' KV tiers, as /metrics renders them: read from an in-process
engine, or from the counts remote instances send in their heartbeats."""

from prometheus_client import CollectorRegistry, generate_latest

from xllm.gateway.kv_tier_metrics import KVTierCollector, from_registry
from xllm.gateway.registry import EmbeddedRegistry
from xllm.kvstore.tier import TierStats
from xllm.proto.registry.v1 import instance_pb2

STATS = {"host": TierStats(queries=5, hits=3, bytes_read=300, load_seconds=0.25, capacity_bytes=1000),
         "disk": TierStats(queries=2, corrupt=1, errors=4, up=False)}
LINES = ('xllm:kv_tier_hits_total{instance="e0",model_name="m",tier="host"} 3.0',
         'xllm:kv_tier_queries_total{instance="e0",model_name="m",tier="disk"} 2.0',
         'xllm:kv_tier_read_bytes_total{instance="e0",model_name="m",tier="host"} 300.0',
         'xllm:kv_tier_load_seconds_total{instance="e0",model_name="m",tier="host"} 0.25',
         'xllm:kv_tier_corrupt_blocks_total{instance="e0",model_name="m",tier="disk"} 1.0',
         'xllm:kv_tier_up{instance="e0",model_name="m",tier="disk"} 0.0',
         'xllm:kv_tier_up{instance="e0",model_name="m",tier="host"} 1.0',
         'xllm:kv_tier_capacity_bytes{instance="e0",model_name="m",tier="host"} 1000.0')


def _scrape(read) -> str:
    registry = CollectorRegistry()
    registry.register(KVTierCollector(read))
    return generate_latest(registry).decode()


def test_tier_stats_become_labelled_counters_and_gauges():
    text = _scrape(lambda: [("m", "e0", STATS)])
    for line in LINES:
        assert line in text, line


def test_a_cluster_gateway_reports_the_tiers_each_instance_sent_in_its_heartbeat():
    reg = EmbeddedRegistry()
    info = instance_pb2.InstanceInfo(instance_id="e0", address="127.0.0.1:1",
                                     model=instance_pb2.ModelInfo(served_name="m", block_size=16))
    lease, _ = reg.grant(info, 10.0)
    silent, _ = reg.grant(instance_pb2.InstanceInfo(instance_id="e1", address="127.0.0.1:2",
                                                    model=instance_pb2.ModelInfo(served_name="m", block_size=16)), 10.0)
    hb = instance_pb2.Heartbeat(instance_id="e0", kv_tiers=[s.to_proto(t) for t, s in STATS.items()])
    assert reg.keepalive(lease, instance_pb2.Heartbeat.FromString(hb.SerializeToString()))  # as sent on the wire
    assert reg.keepalive(silent, instance_pb2.Heartbeat(instance_id="e1"))  # no tiers: no series
    text = _scrape(from_registry(reg))
    for line in LINES:
        assert line in text, line
    assert 'instance="e1"' not in text
