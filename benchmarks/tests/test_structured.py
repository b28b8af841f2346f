"""``python -m benchmarks structured`` in tiny mode: a real ``xllm serve`` on SmolLM2, batch 1, one
short request per mode; the summary's overheads are TPOT(schema) / TPOT(free text) - 1, against free
text of the schema run's length and of ``--output-len`` tokens."""

from __future__ import annotations

import json

import pytest

from benchmarks import structured
from benchmarks.cli import main


def test_overhead_and_summary():
    runs = {"free": {"tpot_ms": {"p50": 10.0, "p90": 11.0}, "completed": 2, "output_throughput": 100.0,
                     "output_tokens": 20},
            "json_schema": {"tpot_ms": {"p50": 10.5, "p90": 12.0}, "completed": 2, "output_throughput": 95.0,
                            "output_tokens": 18},
            "free_same_len": {"tpot_ms": {"p50": 10.2, "p90": 11.0}, "completed": 2,
                              "output_throughput": 99.0, "output_tokens": 18}}
    assert structured.overhead(runs) == pytest.approx(0.05)
    assert structured.overhead(runs, "free_same_len") == pytest.approx(10.5 / 10.2 - 1)
    assert structured.overhead({"free": runs["free"]}) is None
    md = structured.markdown({"records": 1, "output_len": 8, "rounds": 1, "threads": 2, "runs": {"xllm": {"1": runs}}})
    assert "| xllm | 1 | json_schema | 95.0 | 10.5 | 12.0 | 9 | +2.9 % | +5.0 % |" in md


@pytest.mark.real_model
def test_tiny_run(tmp_path):
    rc = main(["structured", "--systems", "xllm", "--batches", "1", "--rounds", "1", "--output-len", "48",
                          "--records", "1", "--min-requests", "1", "--repeats", "1", "--dtype", "float32",
                          "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, results["errors"]
    runs = results["runs"]["xllm"]["1"]
    assert runs["free"]["completed"] == runs["json_schema"]["completed"] == runs["free_same_len"]["completed"] == 1
    assert runs["free"]["output_tokens"] == 48
    assert runs["free_same_len"]["output_tokens"] == max(runs["json_schema"]["output_tokens"], 2)
    assert runs["json_schema"]["tpot_ms"]["p50"] > 0
    assert "json_schema" in (tmp_path / "summary.md").read_text()
