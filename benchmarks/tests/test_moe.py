"""The moe scenario run quick (a small skewed MoE, 4 requests): every configuration's outputs equal the
one-process run's, EPLB switched and evened the load, the simulator's table and its replay of the live windows
(which must reproduce the live imbalance), the summary and the plot."""

from __future__ import annotations

import json

import pytest

from benchmarks import moe
from benchmarks.cli import main


def test_quick_run_writes_the_report(tmp_path):
    assert main(["moe", "--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["errors"] == {}
    live = results["live"]
    assert set(live) == set(moe.CONFIGS)
    assert all(r["equal_to_tp1"] for r in live.values())
    assert live["ep2"]["switches"] == 0 and live["ep2_eplb"]["switches"] >= 1
    assert live["ep2_eplb"]["mean_imbalance"] <= 1.2
    assert [s["ranks"] for s in results["sim"]["synthetic"]] == list(moe.SIM_RANKS)
    for s in results["sim"]["synthetic"]:
        assert s["on_imbalance"] < s["off_imbalance"] and s["on_wait"] < s["off_wait"]
    val = results["sim"]["validation"]
    assert val["sim"] == pytest.approx(val["live"], abs=0.02)  # the simulator's rank loads are the engine's
    text = (tmp_path / "summary.md").read_text()
    assert "| ep2_eplb |" in text and "| 64 |" in text
    assert (tmp_path / "moe.png").stat().st_size > 1000
    assert main(["moe", "--report", str(tmp_path), "--no-plots"]) == 0
