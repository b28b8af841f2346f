"""``python -m benchmarks predictor`` end to end on a tiny random Llama in quick mode (the code path
of the real run: profile, fit, held-out closed-loop run, errors, summary, plot), and its pure parts."""

from __future__ import annotations

import json

import pytest

from benchmarks.cli import main
from benchmarks.predictor import SCENARIO, RequestRecord, quantiles, request_errors, step_errors
from xllm.sched.latency import StepSample, StepShape, StepTimeModel

TRUE = StepTimeModel((0.004, 0.0006, 2e-7, 3e-6, 1e-4))


def test_quick_run_on_a_tiny_model(tmp_path) -> None:
    from xllm.models import resolve_model
    from xllm.testing.models import save_tiny_llama

    tiny = save_tiny_llama(tmp_path / "tiny", resolve_model())
    out = tmp_path / "out"
    plots = [] if _has_matplotlib() else ["--no-plots"]
    assert main(["predictor", "--quick", "--model", str(tiny), "--dtype", "float32", "--threads", "1",
                 "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--out", str(out), *plots]) == 0
    results = json.loads((out / "results.json").read_text())
    assert len(results["requests"]) == 2 * 4  # two concurrency levels of four requests, all finished
    assert sum(lv["steps"] for lv in results["levels"]) == len(results["steps"]) > 0
    for r in results["requests"]:
        assert 8 <= r["prompt"] <= 48 and 2 <= r["output"] <= 8
        assert r["ttft"] > 0 and r["predicted_ttft"] > 0 and r["predicted_tpot"] > 0
        assert r["predicted_tpot_life"] > 0 and r["predicted_ttft_queue"] > 0
    errors = results["step_errors"]["all"]
    assert errors["offline"]["n"] == len(results["steps"]) and errors["offline"]["p50"] >= 0
    assert (out / "profile.json").is_file() and "| all |" in (out / "summary.md").read_text()
    assert ("--no-plots" in plots) or (out / "predictor.png").is_file()


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_step_errors_exact_model_and_drift() -> None:
    shapes = [StepShape((64,) * b) for b in (1, 4, 16)] + [StepShape((), ((0, 128),)), StepShape((32,), ((0, 64),))]
    exact = step_errors(TRUE, [StepSample(s, TRUE.step_seconds(s)) for s in shapes])
    assert exact["all"]["offline"]["mean"] == pytest.approx(0.0, abs=1e-9)
    assert exact["decode"]["offline"]["n"] == 3 and exact["prefill"]["offline"]["n"] == 1
    assert exact["mixed"]["offline"]["n"] == 1
    slow = step_errors(TRUE, [StepSample(s, 2 * TRUE.step_seconds(s)) for s in shapes * 20])
    assert slow["all"]["offline"]["p50"] == pytest.approx(0.5)  # predicted half of measured
    assert slow["all"]["online"]["p50"] < 0.2 and slow["final_correction"] > 1.8  # the correction catches up


def test_request_errors_and_quantiles() -> None:
    assert quantiles([]) == {"n": 0, "p50": None, "p90": None, "mean": None}
    q = quantiles([float(i) for i in range(10)])
    assert q["p50"] == 5.0 and q["p90"] == 9.0 and q["mean"] == 4.5
    recs = [RequestRecord(10, 3, arrival=0.0, predicted_ttft=0.2, predicted_tpot=0.05, first=0.1, last=0.3, tokens=3,
                          predicted_tpot_life=0.125, predicted_ttft_queue=0.1)]
    got = request_errors(recs)
    assert got["ttft"]["p50"] == pytest.approx(1.0) and got["ttft_bias_mean"] == pytest.approx(1.0)
    assert got["tpot"]["p50"] == pytest.approx(0.5) and got["tpot_bias_mean"] == pytest.approx(-0.5)
    assert got["tpot_life"]["p50"] == pytest.approx(0.25) and got["tpot_life_bias_mean"] == pytest.approx(0.25)
    assert got["ttft_queue"]["p50"] == pytest.approx(0.0)


def test_command_line_ranges() -> None:
    args = SCENARIO.parser().parse_args(["--prompt-len", "4..9", "--concurrency", "2,8"])
    assert args.prompt_len == (4, 9) and args.concurrency == [2, 8]
    with pytest.raises(SystemExit):
        SCENARIO.parser().parse_args(["--output-len", "9..4"])
