"""The PD benchmark's pure parts: workload, histogram quantiles, hand-off figures, the table."""

from __future__ import annotations

import argparse
import json
import math
import random

import pytest

from benchmarks.metrics import histogram_quantile
from benchmarks.pd import (
    CONFIGS,
    SCENARIO,
    build_workload,
    markdown,
    pd_figures,
    serve_args,
)
from benchmarks.stats import SLO, RequestRecord, serving_summary


class FakeBank:
    def prompt(self, n: int, rng: random.Random):
        return argparse.Namespace(ids=tuple(rng.randrange(1000) for _ in range(n)), text="")


def test_workload_mixes_long_and_short_prompts_at_poisson_arrivals():
    args = SCENARIO.parser().parse_args(["--requests", "10", "--long-fraction", "0.3", "--long-prompt-len", "64",
                                      "--short-prompt-len", "8", "--output-len", "5", "--rate", "2"])
    w = build_workload(FakeBank(), args)
    assert sum(w.long) == 3 and len(w.specs) == 10
    assert [len(s.prompt_ids) for s in w.specs] == [64 if lg else 8 for lg in w.long]
    assert all(s.output_len == 5 for s in w.specs)
    arrivals = [s.arrival for s in w.specs]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert build_workload(FakeBank(), args).long == w.long  # the same workload for every configuration


def test_histogram_quantile_interpolates_inside_a_bucket():
    buckets = [(0.1, 2.0), (0.2, 6.0), (0.5, 8.0), (math.inf, 8.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.15)   # rank 4 halfway through (0.1, 0.2]
    assert histogram_quantile(buckets, 1.0) == pytest.approx(0.5)
    assert math.isnan(histogram_quantile([], 0.5))


def _scrape(n: float, seconds: float, nbytes: float, breakdown: float) -> dict:
    return {
        "xllm:kv_transfer_bytes_total": [({"transport": "grpc"}, nbytes)],
        "xllm:kv_transfer_seconds_count": [({"transport": "grpc"}, n)],
        "xllm:kv_transfer_seconds_sum": [({"transport": "grpc"}, seconds)],
        "xllm:kv_transfer_seconds_bucket": [({"transport": "grpc", "le": "0.1"}, n),
                                            ({"transport": "grpc", "le": "+Inf"}, n)],
        "xllm:pd_ttft_breakdown_seconds_count": [({"phase": p}, n) for p in ("queue", "prefill", "transfer",
                                                                            "first_decode")],
        "xllm:pd_ttft_breakdown_seconds_sum": [({"phase": p}, breakdown * n) for p in ("queue", "prefill",
                                                                                      "transfer", "first_decode")],
    }


def test_pd_figures_are_what_moved_between_the_scrapes():
    before, after = _scrape(2, 0.1, 1000, 0.5), _scrape(6, 0.3, 5000, 0.5)
    f = pd_figures(before, after, "grpc", requests=4)
    assert f["transfers"] == 4 and f["bytes_per_request"] == 1000
    assert f["transfer_ms_mean"] == pytest.approx(50.0)
    assert f["ttft_breakdown_ms_mean"]["prefill"] == pytest.approx(500.0)
    assert f["transfer_failures"] == 0 and f["prefill_retries"] == 0
    json.dumps(f)


def test_every_configuration_has_its_serve_flags():
    assert serve_args("mixed") == ["--instances", "2"]
    assert "--max-num-batched-tokens" in serve_args("mixed-chunked")
    for config in CONFIGS[2:]:
        args = serve_args(config)
        assert args[:4] == ["--prefill-instances", "1", "--decode-instances", "1"]
        assert args[args.index("--kv-transfer") + 1] == config.removeprefix("pd-")
    # hand-offs through the store go through the engines' T3 tier, on a store `xllm serve` starts
    assert serve_args("pd-mooncake")[-2:] == ["--kv-store", "local-mooncake"]


def test_the_table_has_ratios_and_hand_off_figures():
    def run(ttft: float, tpot: float) -> dict:
        recs = [RequestRecord(prompt_tokens=10, output_tokens=11, ttft=ttft, e2e=ttft + 10 * tpot) for _ in range(4)]
        s = serving_summary(recs, 10.0, SLO(tpot_ms=100))
        return {"summary": s, "long": s, "short": s, "records": [r.to_dict() for r in recs]}

    runs = {"mixed": run(0.5, 0.2), "pd-fd": {**run(0.7, 0.05), "pd": pd_figures({}, _scrape(4, 0.2, 4096, 0.1),
                                                                                   "fd", 4)}}
    meta = dict(model="m", dtype="bfloat16", requests=4, rate=0.2, long_fraction=0.5, long_prompt_len=2048,
                short_prompt_len=128, output_len=11, kv_cache_memory=1.0, slo_tpot_ms=100.0)
    text = markdown(runs, meta, {"pd-grpc": "RuntimeError: boom"})
    assert "| pd-fd | 1.40x | 1.40x | 0.25x | 0.25x |" in text
    assert "pd-grpc failed" in text and "| pd-fd |" in text
    # goodput as the TPOT objective tightens: mixed (200 ms per token) meets none, pd-fd (50 ms) from 50 ms on
    assert "| mixed | 0.000 | 0.000 | 0.000 | 0.000 |" in text and "| pd-fd | 0.000 | 0.000 | 0.400 | 0.400 |" in text
