"""``python -m benchmarks spec``: the workloads' prompts, the acceptance read off two ``/metrics``
scrapes, the speed-up table; and the ``--quick`` run end to end (a real ``xllm serve`` on SmolLM2 without
and with prompt lookup), whose acceptance comes from the server's ``xllm:spec_decode_*`` counters: the
end-to-end test that they move."""

from __future__ import annotations

import json

import pytest

from benchmarks import spec
from benchmarks.cli import main
from benchmarks.metrics import parse


def test_workloads_are_distinct_and_bounded():
    for w in spec.WORKLOADS:
        msgs = spec.workload_messages(w, 6)
        texts = [m[0]["content"] for m in msgs]
        assert len(texts) == 6 and all(texts)
        assert len(set(texts)) > 1
        assert max(map(len, texts)) < 2000
    code = spec.workload_messages("code", 1)[0][0]["content"]
    assert "```python\ndef " in code or "```python\n    def " in code
    with pytest.raises(ValueError, match="unknown workload"):
        spec.workload_messages("poetry", 1)


def _metrics(drafts: float, accepted: float, per_pos: list[float]) -> dict:
    lines = ["# TYPE xllm:spec_decode_num_draft_tokens counter",
             f'xllm:spec_decode_num_draft_tokens_total{{instance="e0"}} {drafts}',
             "# TYPE xllm:spec_decode_num_accepted_tokens counter",
             f'xllm:spec_decode_num_accepted_tokens_total{{instance="e0"}} {accepted}',
             "# TYPE xllm:spec_decode_num_accepted_tokens_per_pos counter"]
    lines += [f'xllm:spec_decode_num_accepted_tokens_per_pos_total{{instance="e0",position="{j}"}} {n}'
              for j, n in enumerate(per_pos)]
    return parse("\n".join(lines) + "\n")


def test_acceptance_is_the_counters_delta():
    a = spec.acceptance("xllm", _metrics(10, 4, [3, 1]), _metrics(40, 19, [12, 6, 1]))
    assert a == {"draft_tokens": 30, "accepted_tokens": 15, "rate": 0.5, "accepted_per_position": [9, 5, 1]}
    assert spec.acceptance("xllm", parse(""), parse(""))["rate"] is None


def _summary(tok_s: float, tpot: float, rate=None, passes=()) -> dict:
    return {"output_throughput": tok_s, "tpot_ms": {"p50": tpot, "p90": tpot}, "completed": 2, "output_tokens": 40,
            "acceptance": {"rate": rate}, "pass_tok_s": list(passes)}


def test_speedups_and_summary():
    results = {"num_speculative_tokens": 3, "output_len": 20, "threads": 2,
               "runs": {"xllm": {"off": {"code": {"1": _summary(50, 20)},
                                         "chat": {"1": _summary(60, 16, passes=(50, 70, 60))}},
                                 "ngram": {"code": {"1": _summary(80, 10, 0.75)},
                                           "chat": {"1": _summary(59, 16.5, 0.0, passes=(55, 63, 60))}}}}}
    ups = {(r["workload"], r["batch"]): r for r in spec.speedups(results)}
    assert ups[("code", 1)]["tok_s"] == pytest.approx(1.6) and ups[("code", 1)]["tpot"] == pytest.approx(2.0)
    assert ups[("chat", 1)]["tok_s"] == pytest.approx(59 / 60)
    # paired pass by pass (1.1, 0.9, 1.0): their median, not the ratio of the pooled rates
    assert ups[("chat", 1)]["tok_s_paired"] == pytest.approx(1.0) and ups[("code", 1)]["tok_s_paired"] is None
    md = spec.markdown(results)
    assert "| xllm | ngram | code | 1 | 80.0 | – | 10.0 | 10.0 | 20 | 75% | 1.60 | – | 2.00 |" in md


@pytest.mark.real_model
def test_quick_run(tmp_path):
    rc = main(["spec", "--quick", "--out", str(tmp_path), "--no-plots"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, results["errors"]
    runs = results["runs"]["xllm"]
    for proposer in ("off", "ngram"):
        for workload in ("code", "chat"):
            s = runs[proposer][workload]["1"]
            assert s["completed"] == 1 and s["output_tokens"] > 1
    # greedy: the same tokens with and without speculation
    assert runs["ngram"]["code"]["1"]["output_tokens"] == runs["off"]["code"]["1"]["output_tokens"]
    assert runs["off"]["code"]["1"]["acceptance"]["draft_tokens"] == 0
    moved = runs["ngram"]["code"]["1"]["acceptance"]  # the server's /metrics counters moved
    assert moved["draft_tokens"] > 0 and 0 < moved["accepted_tokens"] <= moved["draft_tokens"]
    assert sum(moved["accepted_per_position"]) == moved["accepted_tokens"]
    assert "| xllm | ngram | code | 1 |" in (tmp_path / "summary.md").read_text()
