"""The simulator's benchmarks in miniature: ``python -m benchmarks sim`` (every part, a few instances
and requests) and the simulated half of ``sim-validate``; no model, no server."""

from __future__ import annotations

import json

import pytest

from benchmarks import sim, sim_validate
from benchmarks.cli import main
from xllm.sim.profile import write_provisional


def test_sim_ablation_code_path(tmp_path):
    """Every part on the phases workload: rates searched on --search-requests, then confirmed on
    --requests (the reported max rate and attainment are the confirm run's), two jobs."""
    profile = tmp_path / "profile.json"
    write_provisional(profile)  # fixed numbers: the shipped default is re-measured from time to time
    plots = ["--no-plots"]
    try:
        import matplotlib  # noqa: F401
        plots = []
    except ImportError:
        pass
    assert main(["sim", "--instances", "4", "--requests", "150", "--search-requests", "80", "--probes", "1",
                     "--prefix-groups", "3", "--phase-s", "10,10", "--jobs", "2", "--profile", str(profile),
                     "--out", str(tmp_path), *plots]) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["meta"]["slo_ttft_ms"] > 0 and r["meta"]["slo_tpot_ms"] > 0  # derived from the profile
    assert r["meta"]["workload"] == "phases" and r["meta"]["pd_batch"] == 1
    assert list(r["pd"]) == ["dynamic", "dynamic-no-overflow", "static-overflow", "static", "minimal-load"]
    assert [r["pd"][c]["prefill_overflow"] for c in r["pd"]] == [True, False, True, False, False]
    for run in r["pd"].values():
        assert len(run["probes"]) >= 2 and all(p["requests"] == 80 for p in run["probes"])
        passing = [p["rate"] for p in run["probes"] if p["slo_attainment"] >= 0.9]
        assert run["search_rate"] == (max(passing) if passing else 0.0)
        confirms = run["confirms"]
        assert all(c["requests"] == 150 and c["wall_s"] > 0 and c["cpu_s"] > 0 for c in confirms)
        if run["search_rate"]:
            assert confirms[0]["rate"] == run["search_rate"]
            assert run["slo_attainment"] == confirms[-1]["slo_attainment"]
        confirmed = [c["rate"] for c in confirms if c["slo_attainment"] >= 0.9]
        assert run["max_rate"] == (confirmed[0] if confirmed else 0.0)
    assert {"online-only", "decode_first", "colocation"} <= set(r["colocation"])
    assert r["colocation"]["colocation"]["offline"]["completed"] > 0
    assert r["colocation"]["online-only"]["requests_run"] == 150
    summary = (tmp_path / "summary.md").read_text()
    assert "vs minimal-load" in summary and "| colocation |" in summary and "Workload `phases`" in summary
    assert plots or (tmp_path / "sim.png").is_file()


def test_confirm_steps_down_until_the_full_run_meets_the_target():
    calls = []

    def run(rate):
        calls.append(rate)
        return {"slo_attainment": 0.95 if rate <= 25 else 0.8, "goodput": 0, "ttft_ms": {"p99": 0},
                "tpot_ms": {"p99": 0}, "role_flips": 0, "wall_s": 1.0, "cpu_s": 1.0}, 1000

    best, runs = sim.confirm("x", run, 40.0, 1.25, 0.9, 2)
    assert calls == [40.0, 32.0, 25.6] and best == 0.0 and len(runs) == 3  # 25.6 > 25 still misses
    calls.clear()
    best, runs = sim.confirm("x", run, 30.0, 1.25, 0.9, 2)
    assert calls == [30.0, 24.0] and best == 24.0 and runs[-1]["slo_attainment"] == 0.95
    assert sim.confirm("x", run, 0.0, 1.25, 0.9, 2) == (0.0, [])


def test_max_rate_search_brackets_then_bisects():
    calls = []

    def run(rate):
        calls.append(rate)
        return {"slo_attainment": 1.0 if rate <= 30 else 0.5, "goodput": 0, "ttft_ms": {"p99": 0},
                "tpot_ms": {"p99": 0}, "role_flips": 0, "request_throughput": 0, "wall_s": 0, "cpu_s": 0}, 100

    best, history, step = sim.max_rate("x", run, 10.0, 0.9, 4)
    assert calls[:3] == [10.0, 20.0, 40.0] and len(history) == 7
    assert 20.0 <= best <= 30 and best == max(r for r in calls if r <= 30)
    hi = min(r for r in calls if r > 30)
    assert step == pytest.approx(hi / best) and 1 < step < 2 ** (1 / 16) + 1e-9


def test_sim_validate_simulated_half(tmp_path):
    assert main(["sim-validate", "--sim-only", "--requests", "12", "--rate", "0.2", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["sim"]["completed"] == 12 and r["live"] is None
    assert (tmp_path / "trace.csv").read_text().count("\n") == 13


def test_compare_errors():
    live = {"output_throughput": 100.0, "ttft_ms": {"p50": 200.0, "p99": 1000.0}, "tpot_ms": {"p50": 20.0}}
    simd = {"output_throughput": 90.0, "ttft_ms": {"p50": 220.0, "p99": 1000.0}, "tpot_ms": {"p50": 21.0}}
    c = sim_validate.compare(live, simd)
    assert c["output throughput (tok/s)"]["error"] == pytest.approx(-0.1)
    assert c["TTFT p50 (ms)"]["error"] == pytest.approx(0.1)
    assert c["TPOT p50 (ms)"]["error"] == pytest.approx(0.05)
    assert c["TPOT p99 (ms)"]["error"] is None


def test_correction_factors_and_the_corrected_simulation(tmp_path):
    text = ('# HELP xllm:step_time_correction_factor ...\n'
            'xllm:step_time_correction_factor{instance="engine-0",model_name="m"} 1.5\n'
            'xllm:step_time_correction_factor{instance="engine-1",model_name="m"} 2.5\n'
            'xllm:other{instance="engine-0"} 9\n')
    assert sim_validate.per_instance(text, "xllm:step_time_correction_factor") == {"engine-0": 1.5, "engine-1": 2.5}
    args = sim_validate.SCENARIO.parser().parse_args(["--requests", "12", "--rate", "0.2"])
    specs = sim_validate.trace(args)
    base, slow = sim_validate.simulated(args, specs), sim_validate.simulated(args, specs, 2.0)
    assert slow["tpot_ms"]["p50"] == pytest.approx(2 * base["tpot_ms"]["p50"], rel=0.35)
    assert slow["tpot_ms"]["p50"] > base["tpot_ms"]["p50"]


def test_prediction_errors_become_step_noise_and_the_report_shows_the_noisy_simulation(tmp_path):
    """The live instances' recent prediction error (mean |predicted − measured| / measured) sets the
    simulator's step_noise (a lognormal of that mean relative deviation); the summary then has a third
    simulated column."""
    import math
    import random

    text = ('xllm:step_time_prediction_error_recent{instance="engine-0",model_name="m"} 0.08\n'
            'xllm:step_time_prediction_error_recent{instance="engine-1",model_name="m"} 0.12\n')
    errors = sim_validate.per_instance(text, "xllm:step_time_prediction_error_recent")
    assert errors == {"engine-0": 0.08, "engine-1": 0.12}
    sigma = sim_validate.noise_sigma(0.1)
    rng = random.Random(0)
    draws = [math.exp(rng.gauss(-sigma * sigma / 2, sigma)) for _ in range(20000)]
    assert sum(abs(x - 1) for x in draws) / len(draws) == pytest.approx(0.1, rel=0.05)  # the oracle: sampling
    args = sim_validate.SCENARIO.parser().parse_args(["--requests", "12", "--rate", "0.2"])
    specs = sim_validate.trace(args)
    live = sim_validate.simulated(args, specs)
    results = {"meta": {**vars(args), "profile": "p", "provisional": False, "correction_factor": 1.0,
                        "step_noise": sigma},
               "comparison": sim_validate.compare(live, live), "comparison_corrected": sim_validate.compare(live, live),
               "comparison_noisy": sim_validate.compare(live, sim_validate.simulated(args, specs, 1.0, sigma))}
    text = sim_validate.markdown(results)
    assert "corrected + noise" in text and f"--step-noise {sigma:.3f}" in text
    assert all(line.count("|") == 9 for line in text.splitlines() if line.startswith("| TTFT"))


def test_the_correction_is_the_traces_measured_over_predicted_step_time():
    """Between the scrapes before and after the trace: each instance's increments of measured and
    predicted step seconds; the correction is their ratio over all instances' steps."""
    def scrape(m0, p0, m1, p1):
        return (f'xllm:step_time_measured_seconds_total{{instance="engine-0",model_name="m"}} {m0}\n'
                f'xllm:step_time_predicted_seconds_total{{instance="engine-0",model_name="m"}} {p0}\n'
                f'xllm:step_time_measured_seconds_total{{instance="engine-1",model_name="m"}} {m1}\n'
                f'xllm:step_time_predicted_seconds_total{{instance="engine-1",model_name="m"}} {p1}\n')

    seconds = sim_validate.step_seconds(scrape(2.0, 1.0, 1.0, 1.0), scrape(14.0, 11.0, 31.0, 26.0))
    assert seconds == {"engine-0": {"measured": 12.0, "predicted": 10.0},
                       "engine-1": {"measured": 30.0, "predicted": 25.0}}
    assert sim_validate.run_ratio(seconds) == pytest.approx(42.0 / 35.0)
    assert sim_validate.run_ratio({}) is None


def test_a_profile_of_another_engine_is_refused(tmp_path):
    from xllm.sched.latency import PerfProfile, StepSample, StepShape

    samples = [StepSample(StepShape((100,)), 0.02), StepSample(StepShape((), ((0, 64),)), 0.05)]
    path = tmp_path / "p.json"
    PerfProfile("m", "bfloat16", 1, "x", 512, samples, weights="q4_1").save(path)
    with pytest.raises(SystemExit, match=r"weights float \(profile: q4_1\)"):
        sim_validate.check_profile(path, "bfloat16")
    PerfProfile("m", "bfloat16", 1, "x", 512, samples, weights="").save(path)
    sim_validate.check_profile(path, "bfloat16")
    with pytest.raises(SystemExit, match="dtype float32"):
        sim_validate.check_profile(path, "float32")
    assert PerfProfile.load(path).weights == ""
