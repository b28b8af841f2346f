import json

import pytest

from benchmarks.stats import cv, mean
from benchmarks.workload import (
    LengthDist,
    SpecError,
    TraceEntry,
    TraceError,
    burst_arrivals,
    gamma_arrivals,
    gaps,
    load_trace,
    parse_trace,
    poisson_arrivals,
    scale_trace,
)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poisson_mean_rate_and_cv(seed):
    arr = poisson_arrivals(rate=4.0, n=4000, seed=seed)
    g = gaps(arr)
    assert all(x > 0 for x in g)
    assert arr == sorted(arr)
    assert 1 / mean(g) == pytest.approx(4.0, rel=0.06)
    assert cv(g) == pytest.approx(1.0, abs=0.06)


@pytest.mark.parametrize(("cv_target", "seed"), [(0.5, 0), (2.0, 0), (3.0, 1)])
def test_gamma_mean_rate_and_cv(cv_target, seed):
    g = gaps(gamma_arrivals(rate=2.0, cv=cv_target, n=20000, seed=seed))
    assert 1 / mean(g) == pytest.approx(2.0, rel=0.08)
    assert cv(g) == pytest.approx(cv_target, rel=0.1)


def test_arrivals_are_reproducible_and_validated():
    assert poisson_arrivals(1.0, 5, seed=3) == poisson_arrivals(1.0, 5, seed=3)
    assert poisson_arrivals(1.0, 5, seed=3) != poisson_arrivals(1.0, 5, seed=4)
    assert burst_arrivals(3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(0, 5)
    with pytest.raises(ValueError):
        gamma_arrivals(1.0, 0, 5)


def test_length_specs():
    assert LengthDist.parse("32").sample(3) == [32, 32, 32]
    u = LengthDist.parse("uniform:16:64").sample(2000, seed=1)
    assert min(u) >= 16 and max(u) <= 64 and min(u) == 16 and max(u) == 64
    ln = LengthDist.parse("lognormal:128:0.5:1000")
    xs = ln.sample(5000, seed=2)
    assert min(xs) >= 1 and max(xs) <= 1000
    assert mean(xs) == pytest.approx(128, rel=0.05)
    assert LengthDist.parse("uniform:16:64").max == 64
    for bad in ("0", "uniform:64:16", "uniform:a:b", "zipf:1:2", "lognormal:10", "-3", ""):
        with pytest.raises(SpecError):
            LengthDist.parse(bad)


def test_trace_csv_with_header_comments_and_rebase():
    text = "# a trace\narrival,prompt_len,output_len\n10.5,32,128\n\n11.0, 64 ,16\n11.0\t8\t8\n"
    assert parse_trace(text) == [TraceEntry(0.0, 32, 128), TraceEntry(0.5, 64, 16), TraceEntry(0.5, 8, 8)]


def test_trace_jsonl_and_whitespace():
    lines = [json.dumps({"arrival": 0, "prompt_len": 5, "output_len": 7}),
             json.dumps({"arrival": 1.25, "prompt_len": 6.0, "output_len": 8, "extra": "ignored"})]
    assert parse_trace("\n".join(lines)) == [TraceEntry(0.0, 5, 7), TraceEntry(1.25, 6, 8)]
    assert parse_trace("0 4 4\n2 5 5") == [TraceEntry(0, 4, 4), TraceEntry(2, 5, 5)]


@pytest.mark.parametrize(("text", "message"), [
    ("0,32,128\n1,32", "t.csv:2: expected 3 fields"),
    ("0,32,128\nsoon,32,128", "t.csv:2: arrival 'soon' is not a number"),
    ("0,32,128\n1,3.5,128", "t.csv:2: prompt_len '3.5' is not an integer"),
    ("0,32,0", "t.csv:1: output_len must be >= 1"),
    ("-1,32,8", "t.csv:1: arrival must be a finite number >= 0"),
    ("5,32,8\n4,32,8", "t.csv:2: arrival 4.0 is before the previous one"),
    ('{"arrival": 0, "prompt_len": 3}', "t.csv:1: missing field(s) output_len"),
    ('{"arrival": 0, ', "t.csv:1: invalid JSON"),
    ('{"arrival": 0, "prompt_len": true, "output_len": 3}', "t.csv:1: prompt_len True is not an integer"),
    ("# only comments\n\n", "t.csv: no requests"),
])
def test_trace_bad_lines_give_clear_errors(text, message):
    with pytest.raises(TraceError) as info:
        parse_trace(text, "t.csv")
    assert message in str(info.value)


def test_load_trace_file_and_speedup(tmp_path):
    p = tmp_path / "trace.csv"
    p.write_text("0,10,20\n4,10,20\n")
    entries = load_trace(p)
    assert scale_trace(entries, 2.0)[1].arrival == 2.0
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.csv")
    with pytest.raises(ValueError):
        scale_trace(entries, 0)
