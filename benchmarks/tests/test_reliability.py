"""The reliability benchmark's pure parts: the character diff, stream comparison with near-ties,
error-body checks, the table, the scenario list and the engines' KV block counts from their logs."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import pytest

from benchmarks.clusters import kv_blocks
from benchmarks.reliability import SCENARIOS, markdown, scenario_list, table
from benchmarks.streamcheck import Row, Stream, char_diff, compare, openai_error_problem, status_counts


@pytest.mark.parametrize(("got", "ref", "want"), [
    ("once upon a time", "once upon a time", (0, 0)),
    ("once upon time", "once upon a time", (2, 0)),        # "a " lost where the stream moved
    ("once upon a a time", "once upon a time", (0, 2)),    # "a " repeated
    ("once upon b time", "once upon a time", (1, 1)),      # one character replaced: one missing, one extra
    ("", "abc", (3, 0)),
    ("abc", "", (0, 3)),
])
def test_char_diff_counts_missing_and_extra_characters(got, ref, want):
    assert char_diff(got, ref) == want


def test_char_diff_has_no_junk_heuristic_on_long_repetitive_text():
    ref = "ab" * 400
    assert char_diff(ref[:300] + ref[302:], ref) == (2, 0)


def _stream(text: str, tokens: list[str] | None = None, top: list[dict] | None = None) -> Stream:
    return Stream(status=200, text=text, tokens=tokens or list(text), top=top or [], finish=["length"])


def test_compare_counts_differences_and_sets_near_ties_apart():
    ref = [_stream("abcd", top=[{"a": -0.1, "x": -3.0}, {"b": -0.5, "y": -0.5004}, {"c": -1.0, "z": -2.0},
                                {"d": -1.0, "w": -2.0}]),
           _stream("efgh", top=[{"e": -0.1, "q": -3.0}] * 4),
           _stream("ijkl"), _stream("mnop")]
    got = [_stream("aycd"),    # greedy, parts at token 1 where the top-2 are 4e-4 apart: a near-tie
           _stream("eqgh"),    # greedy, parts at a clear margin: counted
           _stream("ijl"),     # sampled: one character lost
           _stream("mnop")]
    c = compare(got, ref, greedy=[True, True, False, False])
    assert (c.ties, c.differing, c.lost) == (1, 2, 2 + 1)


def test_compare_does_not_excuse_a_sampled_stream_at_a_near_tie():
    ref = [_stream("ab", top=[{"a": -0.5, "x": -0.5}, {"b": -1.0, "y": -2.0}])]
    c = compare([_stream("xb")], ref, greedy=[False])
    assert (c.ties, c.differing, c.lost) == (0, 1, 2)


def test_a_stream_is_complete_only_with_every_token_and_no_error():
    ok = Stream(status=200, text="abc", finish=["length"], usage={"completion_tokens": 3})
    assert ok.complete(3)
    assert not ok.complete(4)
    assert not Stream(status=200, text="abc", finish=["length"], errors=["boom"]).complete(3)
    assert not Stream(status=200, text="", finish=["length"]).complete(3)
    assert not Stream(status=503, text="", finish=[]).complete(3)
    assert not Stream(status=200, text="abc", finish=[]).complete(3)  # cut before the end


def test_status_counts():
    assert status_counts([Stream(status=s) for s in (200, 400, 404, 503, 500, None)]) == (2, 2)


ERR = {"error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}


@pytest.mark.parametrize(("status", "ctype", "payload", "problem"), [
    (400, "application/json", ERR, None),
    (500, "application/json", ERR, "HTTP 500, expected 400"),
    (400, "text/plain", ERR, "content-type"),
    (400, "application/json", {"detail": "bad"}, "not an OpenAI error body"),
    (400, "application/json", {"error": {"message": "bad", "type": "invalid_request_error"}}, "error fields"),
    (400, "application/json", {"error": {**ERR["error"], "param": "m"}}, "type/param"),
])
def test_openai_error_problem(status, ctype, payload, problem):
    got = openai_error_problem(status, ctype, payload, 400, "n", "invalid_request_error")
    assert got is None if problem is None else problem in got


def test_table_has_one_line_per_row_and_marks_failures():
    rows = [asdict(Row("kill9", "kill -9", cases=32, answered=32, lost_chars=0, leaked_blocks=0, recover_s=3.04,
                       recover_what="fault → last stream done")),
            asdict(Row("hostile", "hostile", cases=78, answered=77, c4xx=77, c5xx=1, problems=["x: HTTP 500"]))]
    rows.append(asdict(Row("flood", "flood", cases=64, answered=64, c5xx=48, c5xx_all_503=True)))
    lines = table(rows)
    assert len(lines) == 5
    assert lines[2] == "| kill -9 | 32 | 32 | 0 | 0 | 0 | 0 | 3.0 s (fault → last stream done) | ok |"
    assert lines[3] == "| hostile | 78 | 77 | 77 | 1 | – | – | – | FAIL |"
    assert lines[4] == "| flood | 64 | 64 | 0 | 48 (all 503 + Retry-After) | – | – | – | ok |"
    meta = {"model": "tiny", "dtype": "float32", "timestamp": "t", "kv_cache_memory": 0.1, "machine": {}}
    md = markdown(rows, meta, {"etcd": "TimeoutError: x"})
    assert "**FAILED**: x: HTTP 500" in md and "**etcd did not run to the end**" in md


def test_scenario_list_keeps_the_table_order_and_rejects_unknown_names():
    assert scenario_list("sigterm,streams") == ["streams", "sigterm"]
    assert scenario_list(",".join(reversed(SCENARIOS))) == list(SCENARIOS)
    with pytest.raises(argparse.ArgumentTypeError):
        scenario_list("streams,nope")


def test_kv_blocks_from_the_engines_start_up_lines(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("x INFO xllm.core.engine: engine engine-0: max_model_len=2048 kv=XTensorKVCache blocks=3276 x 32 "
                   "tokens (104832 tokens) prefix_cache=True\nnoise\n"
                   "y INFO xllm.core.engine: engine engine-1: max_model_len=2048 kv=PagedKVCache blocks=12 x 16 "
                   "tokens\n")
    assert kv_blocks(log, tmp_path / "missing.log") == {"engine-0": 3276, "engine-1": 12}
