"""The routing benchmark's pure parts: workload, summaries, metric parsing, the table."""

from __future__ import annotations

import json

import pytest

from benchmarks.metrics import router_reasons
from benchmarks.routing import (
    SCENARIO,
    Result,
    build_workload,
    default_kv_memory_gib,
    engine_hit_rate,
    markdown,
    summarize,
)


def test_workload_has_every_prefix_user_pair_once_shuffled_with_arrivals():
    prefixes = [(1, 2, 3), (4, 5, 6)]
    suffixes = [[(10,), (11,), (12,)], [(20,), (21,), (22,)]]
    w = build_workload(prefixes, suffixes, output_len=8, rate=2.0, seed=1)
    assert sorted((r.prefix, r.user) for r in w) == [(p, u) for p in range(2) for u in range(3)]
    assert all(r.prompt_ids == prefixes[r.prefix] + suffixes[r.prefix][r.user] for r in w)
    assert [r.arrival for r in w] == sorted(r.arrival for r in w) and w[0].arrival > 0
    assert build_workload(prefixes, suffixes, 8, 2.0, seed=1) == w  # same seed, same workload for every policy
    assert [(r.prefix, r.user) for r in w] != [(p, u) for p in range(2) for u in range(3)]


def test_summary_counts_hits_latencies_and_spread():
    results = [Result(0, 0, 100, cached_tokens=0, output_tokens=4, ttft=0.5, e2e=1.0, instance="a"),
               Result(0, 1, 100, cached_tokens=96, output_tokens=4, ttft=0.1, e2e=0.4, instance="a"),
               Result(1, 0, 100, cached_tokens=64, output_tokens=4, ttft=0.2, e2e=0.5, instance="b"),
               Result(1, 1, 100, error="HTTP 503")]
    s = summarize(results, duration=2.0)
    assert (s["requests"], s["failed"]) == (4, 1)
    assert s["hit_rate"] == pytest.approx(160 / 300)
    assert s["requests_with_hit"] == pytest.approx(2 / 3)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["by_instance"] == {"a": 2, "b": 1} and s["req_per_s"] == 1.5
    json.dumps(s)


METRICS = """# HELP xllm:prefix_cache_hits_total Prompt tokens found in the prefix cache.
xllm:prefix_cache_hits_total{instance="engine-0",model_name="m"} 300.0
xllm:prefix_cache_hits_total{instance="engine-1",model_name="m"} 100.0
xllm:prefix_cache_queries_total{instance="engine-0",model_name="m"} 500.0
xllm:prefix_cache_queries_total{instance="engine-1",model_name="m"} 500.0
xllm:router_requests_total{instance="engine-0",model_name="m",reason="kv_cache"} 5.0
xllm:router_requests_total{instance="engine-1",model_name="m",reason="kv_cache"} 2.0
xllm:router_requests_total{instance="engine-1",model_name="m",reason="least_latency"} 3.0
"""


def test_metric_parsing():
    assert engine_hit_rate(METRICS) == pytest.approx(0.4)
    assert engine_hit_rate("") is None
    assert router_reasons(METRICS) == {"kv_cache": 7, "least_latency": 3}


def test_table_and_defaults(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_key_value_heads": 3,
                                                      "hidden_size": 576, "num_attention_heads": 9}))
    gib = default_kv_memory_gib(tmp_path, "bfloat16", prefixes=6, prefix_len=640)
    assert gib == pytest.approx((0.7 * 6 * 640 + 256) * 30 * 2 * 3 * 64 * 2 / 2**30, abs=1e-4)
    args = SCENARIO.parser().parse_args([])
    assert args.policies.split(",") == ["round_robin", "least_load", "kv_aware"] and args.instances == 2
    s = summarize([Result(0, 0, 10, cached_tokens=5, ttft=0.1, e2e=0.2, instance="a")], 1.0)
    meta = {"instances": 2, "prefixes": 6, "users": 10, "model": "m", "dtype": "bfloat16", "prefix_len": 640,
            "suffix_len": 32, "output_len": 16, "rate": 1.0, "kv_cache_memory": 0.06, "threads": 1,
            "cpu_busy_before": 0.5, "cpu_busy_after": None}
    table = markdown({"kv_aware": {"summary": s, "engine_hit_rate": 0.5}}, meta)
    assert "| kv_aware | 50.0% | 100% | 50.0% | 100 |" in table and "CPU busy before/after: 50% / ?" in table
