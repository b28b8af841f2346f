import math
import random

import pytest

from benchmarks.stats import (
    SLO,
    RequestRecord,
    cv,
    goodput,
    mean,
    offline_summary,
    percentile,
    serving_summary,
    slo_attainment,
    stdev,
    summarize,
)


def test_percentile_known_values():
    xs = [15, 20, 35, 40, 50]
    assert percentile(xs, 0) == 15
    assert percentile(xs, 100) == 50
    assert percentile(xs, 50) == 35
    assert percentile(xs, 40) == pytest.approx(29.0)  # linear between 20 and 35
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(1)
    for n in (1, 2, 3, 10, 101, 1000):
        xs = [rng.lognormvariate(0, 1) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
        assert stdev(xs) == pytest.approx(float(np.std(xs)), rel=1e-9)
        assert mean(xs) == pytest.approx(float(np.mean(xs)), rel=1e-12)


def test_summarize_scales_and_names_percentiles():
    s = summarize([0.1, 0.2, 0.3], scale=1e3)
    assert s["n"] == 3
    assert s["p50"] == pytest.approx(200)
    assert s["min"] == pytest.approx(100) and s["max"] == pytest.approx(300)
    assert set(s) == {"n", "mean", "std", "min", "max", "p50", "p90", "p99"}
    empty = summarize([])
    assert empty["n"] == 0 and math.isnan(empty["p99"])
    assert cv([1.0, 1.0, 1.0]) == 0.0


def rec(ttft, e2e, n=11, ok=True):
    return RequestRecord(prompt_tokens=32, output_tokens=n, success=ok, ttft=ttft, e2e=e2e)


def test_tpot_is_time_after_first_token_per_remaining_token():
    assert rec(0.5, 1.5, 11).tpot == pytest.approx(0.1)
    assert rec(0.5, 0.5, 1).tpot is None          # one token: no TPOT
    assert rec(0.5, 1.5, ok=False).tpot is None


def test_slo_attainment_and_goodput():
    records = [rec(0.1, 1.1), rec(0.1, 2.1), rec(2.0, 3.0), rec(0.1, 1.1, ok=False)]
    # TPOTs: 0.1, 0.2, 0.1; TTFTs 0.1, 0.1, 2.0; the failed one never meets an SLO
    assert slo_attainment(records, SLO(tpot_ms=150)) == pytest.approx(2 / 4)
    assert slo_attainment(records, SLO(ttft_ms=500)) == pytest.approx(2 / 4)
    assert slo_attainment(records, SLO(ttft_ms=500, tpot_ms=150)) == pytest.approx(1 / 4)
    assert slo_attainment(records, SLO()) == pytest.approx(3 / 4)
    assert slo_attainment(records, SLO(e2e_ms=1500)) == pytest.approx(1 / 4)
    assert goodput(records, SLO(tpot_ms=150), duration=4.0) == pytest.approx(0.5)
    assert math.isnan(slo_attainment([], SLO()))
    with pytest.raises(ValueError):
        goodput(records, SLO(), 0)
    # a one-token response meets a TPOT objective (it has no TPOT) but not a failed TTFT
    assert SLO(tpot_ms=1).met_by(rec(0.1, 0.1, n=1))
    assert not SLO(ttft_ms=50).met_by(rec(0.1, 0.1, n=1))
    assert SLO(ttft_ms=500, tpot_ms=100).describe() == "TTFT <= 500 ms, TPOT <= 100 ms"


def test_serving_summary_throughput_and_percentiles():
    records = [rec(0.1, 1.1), rec(0.3, 2.3), rec(0.1, 1.1, ok=False)]
    records[0].itls = [0.1] * 10
    s = serving_summary(records, duration=2.0, slo=SLO(tpot_ms=150))
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["output_tokens"] == 22 and s["prompt_tokens"] == 64
    assert s["output_throughput"] == pytest.approx(11.0)
    assert s["total_throughput"] == pytest.approx(43.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200)
    assert s["tpot_ms"]["p50"] == pytest.approx(150)
    assert s["itl_ms"]["n"] == 10
    assert s["decode_tok_s_per_request"] == pytest.approx(1000 / 150)
    assert s["slo_attainment"] == pytest.approx(1 / 3)  # the second one's TPOT is 200 ms; the third failed
    assert s["goodput"] == pytest.approx(0.5)


def test_offline_summary():
    s = offline_summary(prompt_tokens=64, output_tokens=256, elapsed=2.0, step_latencies=[0.01, 0.03], requests=2)
    assert s["output_throughput"] == 128 and s["total_throughput"] == 160
    assert s["step_ms"]["p50"] == pytest.approx(20)
