"""The elastic benchmark: its pure parts (cases, workload, offline figures, the table) and its whole code
path in quick mode against live servers on a tiny random model."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from benchmarks.cli import main
from benchmarks.elastic import (
    CASES,
    SCENARIO,
    available_cases,
    build_workload,
    markdown,
    offline_figures,
    serve_command,
    serve_supports,
)
from benchmarks.stats import RequestRecord


class FakeBank:
    def prompt(self, n: int, rng: random.Random):
        return argparse.Namespace(ids=tuple(rng.randrange(1000) for _ in range(n)), text="")


def test_cases_have_their_flags_and_pd_cases_follow_the_server():
    args = SCENARIO.parser().parse_args(["--threads", "2", "--slo-tpot-ms", "80"])
    for case in CASES.values():
        cmd = serve_command(case, args, "/m", 1234)
        assert cmd[cmd.index("--slo-tpot-ms") + 1] == "80"
        assert cmd[cmd.index("--threads") + 1] == str(max(1, 2 // case.instances))
    assert "--pd-policy" in serve_command(CASES["pd-dynamic"], args, "/m", 1)
    assert CASES["colocation-on"].offline == "flex" and CASES["colocation-off"].offline == "online"
    assert CASES["online-only"].offline is None
    pd = {"pd-static", "pd-dynamic"}
    assert (pd <= set(available_cases())) == serve_supports("--pd-policy")


def test_workload_is_a_steady_or_bursty_stream_plus_a_backlog_at_the_start():
    args = SCENARIO.parser().parse_args(["--online-requests", "20", "--offline-requests", "5", "--rate", "2",
                                      "--online-prompt-len", "8", "--offline-prompt-len", "12"])
    steady = build_workload(FakeBank(), args, bursty=False)
    assert len(steady.online) == 20 and len(steady.offline) == 5
    assert all(len(s.prompt_ids) == 8 for s in steady.online) and all(len(s.prompt_ids) == 12 for s in steady.offline)
    assert all(s.arrival == 0.0 for s in steady.offline)
    times = [s.arrival for s in steady.online]
    assert times == sorted(times) and times[-1] > 0
    again = build_workload(FakeBank(), args, bursty=False)
    assert [s.prompt_ids for s in again.online] == [s.prompt_ids for s in steady.online]  # the same for every case
    bursty = build_workload(FakeBank(), args, bursty=True)
    assert [s.arrival for s in bursty.online] != times


def record(start: float, ttft: float, itls: list[float], tokens: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(prompt_tokens=4, output_tokens=tokens, success=ok, ttft=ttft, itls=itls, start=start,
                         e2e=ttft + sum(itls))


def test_offline_figures_count_the_tokens_streamed_inside_the_online_window():
    recs = [record(0.0, 1.0, [1.0, 1.0, 1.0], 4),      # chunks at 1, 2, 3, 4
            record(0.5, 3.0, [2.0], 2),                  # chunks at 3.5, 5.5
            RequestRecord(prompt_tokens=4, success=False, error="x")]
    f = offline_figures(recs, window=3.5)
    assert f["tokens_in_window"] == 4  # 1, 2, 3 and 3.5
    assert f["tok_s_in_window"] == pytest.approx(4 / 3.5)
    assert f["makespan_s"] == pytest.approx(5.5) and f["output_tokens"] == 6
    assert (f["completed"], f["failed"]) == (2, 1)


def test_markdown_has_a_row_per_case():
    online = {"failed": 0, "ttft_ms": {"p50": 100.0, "p99": 300.0}, "tpot_ms": {"p50": 40.0, "p99": 90.0}}
    sched = {"offline_preemptions": {"kv": 0, "batch_full": 3, "slo": 7}, "offline_longest_wait_s": 1.5}
    results = {"meta": {"online_requests": 8, "rate": 1.0, "online_prompt_len": 16, "online_output_len": 8,
                        "slo_ttft_ms": 1000.0, "slo_tpot_ms": 100.0, "offline_requests": 4, "offline_prompt_len": 32,
                        "offline_output_len": 16, "dtype": "float32", "threads": 2, "max_num_seqs": 4},
               "runs": {"online-only": {"attainment": {"both": 1.0, "ttft": 1.0, "tpot": 1.0}, "online": online,
                                        "offline": None, "scheduler": sched},
                        "colocation-on": {"attainment": {"both": 0.9, "ttft": 1.0, "tpot": 0.9}, "online": online,
                                          "offline": {"tok_s_in_window": 12.5, "tok_s_overall": 20.0,
                                                      "makespan_s": 9.0, "failed": 0}, "scheduler": sched}},
               "errors": {"pd-dynamic": "boom"}}
    text = markdown(results)
    assert "| online-only | 100% |" in text and "| colocation-on | 90% |" in text
    assert "12.5" in text and "0 / 3 / 7" in text and "pd-dynamic: boom" in text


def test_unknown_case_is_refused(capsys):
    assert main(["elastic", "--cases", "colocation-maybe", "--quick"]) == 2
    assert "colocation-maybe" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_mode_runs_every_colocation_case_live(tmp_path):
    """The whole path: three servers on a tiny random Llama, the online stream and the flex backlog,
    /metrics scrapes, results.json and summary.md."""
    pytest.importorskip("transformers")
    from xllm.models import resolve_model
    from xllm.testing.models import save_tiny_llama

    model = save_tiny_llama(tmp_path / "tiny", resolve_model(progress=False))
    out = tmp_path / "out"
    code = main(["elastic", "--quick", "--model", str(model), "--out", str(out), "--no-plots", "--dtype", "float32",
                 "--threads", "1", "--xllm-args", "--kv-cache-memory 0.05"])
    results = json.loads((out / "results.json").read_text())
    assert code == 0, results["errors"]
    assert list(results["runs"]) == ["online-only", "colocation-off", "colocation-on"]
    for name, run in results["runs"].items():
        assert run["online"]["completed"] == 4 and run["online"]["failed"] == 0, name
    on = results["runs"]["colocation-on"]
    assert on["offline"]["completed"] == 3 and on["offline"]["output_tokens"] == 3 * 8
    assert on["scheduler"]["offline_generation_tokens"] == 3 * 8  # the engine saw the backlog as offline
    assert results["runs"]["colocation-off"]["scheduler"]["offline_generation_tokens"] == 0
    assert "| colocation-on |" in (out / "summary.md").read_text()
