"""The kv_tiers benchmark's pure parts: the chat trace, the cluster summaries, metric parsing, the report."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.kv_tiers import SCENARIO
from benchmarks.kv_tiers_cluster import TurnResult, chat_trace, summarize, tier_hits, working_set_tokens
from benchmarks.kv_tiers_report import markdown, plot


class FakeTokenizer:
    """A chat template of one token per character, each message framed by a role token."""

    def apply_chat_template(self, history):
        out = []
        for m in history:
            out += [{"system": 1, "user": 2, "assistant": 3}[m["role"]], *(ord(c) for c in m["content"]), 0]
        return [*out, 3]  # the generation prompt


def test_each_turn_extends_the_last_and_every_run_sees_the_same_prompts():
    trace = chat_trace(FakeTokenizer(), sessions=6, turns=3, seed=4, system_repeat=2)
    assert chat_trace(FakeTokenizer(), 6, 3, 4, 2) == trace
    for chat in trace:
        assert len(chat) == 3
        for before, after in itertools.pairwise(chat):
            assert after[:len(before) - 1] == before[:-1] and len(after) > len(before)  # (less the generation prompt)
    assert trace[0][0][:50] == trace[4][0][:50]  # sessions 0 and 4 share system prompt 0
    # distinct blocks of the last prompts: shared system prompts counted once
    assert working_set_tokens(trace, 8) < sum(len(c[-1]) for c in trace)
    noted = chat_trace(FakeTokenizer(), sessions=6, turns=3, seed=4, system_repeat=2, notes=5)
    assert all(len(a[0]) > len(b[0]) + 5 * 40 for a, b in zip(noted, trace))  # the notes: a long prefix of its own
    common = next(j for j, (a, b) in enumerate(zip(noted[0][0], noted[4][0])) if a != b)
    assert common < len(noted[0][0]) // 2  # the same system prompt, then notes of each chat's own
    assert noted[0][1][:len(noted[0][0]) - 1] == noted[0][0][:-1]  # later turns keep the notes


def test_cluster_summary_counts_hits_ttft_later_turns_and_spread():
    results = [TurnResult(0, 0, 100, 0, 0.5, "e0"), TurnResult(0, 1, 200, 150, 0.1, "e0"),
               TurnResult(1, 1, 200, 50, 0.3, "e1"), TurnResult(1, 2, 300, 0, None, None, "HTTP 503")]
    s = summarize(results, 10.0)
    assert (s["requests"], s["failed"]) == (4, 1)
    assert s["hit_rate"] == pytest.approx(200 / 500) and s["later_turn_hit_rate"] == pytest.approx(200 / 400)
    assert s["by_instance"] == {"e0": 2, "e1": 1}
    assert s["later_turn_ttft_p50_ms"] == pytest.approx(200.0)


def test_tier_hits_per_instance_and_tier():
    text = ('xllm:kv_tier_hits_total{instance="e0",model_name="m",tier="host"} 12.0\n'
            'xllm:kv_tier_hits_total{instance="e1",model_name="m",tier="store"} 3.0\n')
    assert tier_hits(text) == {"e0": {"host": 12.0}, "e1": {"store": 3.0}}


def test_the_report_tables_every_part_and_plots(tmp_path):
    session = {"requests": 10, "prompt_tokens": 1000, "working_set_tokens": 2560, "t0_capacity_tokens": 640,
               "hit_rate": 0.5, "ttft_p50_ms": 100.0, "ttft_p99_ms": 300.0, "ttft_mean_ms": 150.0,
               "tiers": {"host": {"hits": 7}}}
    run = {"summary": summarize([TurnResult(0, 1, 100, 64, 0.2, "e0")], 1.0),
           "tier_hits": {"e0": {"host": 2.0}}, "reasons": {}, "turns": []}
    result = {"date": "d", "model": "m", "dtype": "bf16", "threads": 2, "t0_kv_gib": 0.015, "commit": "abc",
              "load_average_before": [1.0, 1.0, 1.0], "load_average_after": [2.0, 2.0, 2.0],
              "sessions": {"t0": [session], "+host": [session]},
              "break_even": {"host": {"rows": [{"prefix_tokens": 64, "recompute_ms": 50.0, "load_ms": 10.0}],
                                      "read_mb_per_s": 500.0, "break_even_tokens": 64}},
              "cluster": {"host": {"kv_aware": [run, run], "least_load": [{"error": "boom"}]}}}
    md = markdown(result)
    assert "| +host | 1 | 10 | 4.0x | 50.0% |" in md
    assert "| host | 64 | 50.0 | 10.0 | 0.20 |" in md and "from 64 tokens" in md
    assert "| host | kv_aware | 64.0% |" in md and "e0: host 2" in md and "failed: boom" in md
    assert "| host | kv_aware (round 2) | 64.0% |" in md
    assert plot(result, tmp_path / "kv_tiers.png") == "kv_tiers.png" and (tmp_path / "kv_tiers.png").stat().st_size
    args = SCENARIO.parser().parse_args(["--quick", "--parts", "cluster"])
    assert args.quick and args.parts == "cluster" and args.report is None


def test_break_even_fit_finds_where_loading_stays_faster_and_where_the_lines_cross():
    from benchmarks.kv_tiers_report import break_even_fit

    rows = [{"prefix_tokens": n, "recompute_ms": 10 + 2.0 * n, "load_ms": 60 + 0.5 * n} for n in (16, 64, 256, 1024)]
    fit = break_even_fit(rows)
    assert (fit["recompute_ms_per_1k_tokens"], fit["load_ms_per_1k_tokens"]) == pytest.approx((2000, 500))
    assert fit["crossover_tokens"] == 33 and fit["break_even_tokens"] == 64  # 16 tokens: 42 ms against 68
    never = [{"prefix_tokens": n, "recompute_ms": 1.0, "load_ms": 2.0} for n in (64, 128)]
    assert break_even_fit(never)["break_even_tokens"] is None and break_even_fit(never)["crossover_tokens"] is None
