"""Traces: the Azure LLM inference trace CSV, the benchmarks' CSV, synthetic arrivals and lengths."""

from __future__ import annotations

import pathlib
import statistics

import pytest

from xllm.sim import LengthDist, TraceError, Workload, load_trace, parse_trace, synthetic

DATA = pathlib.Path(__file__).parent / "data"


def test_azure_sample():
    specs = load_trace(DATA / "azure_sample.csv")
    assert [(s.prompt_len, s.output_len) for s in specs] == [(374, 44), (396, 109), (879, 1), (91, 27)]
    assert [round(s.arrival, 7) for s in specs] == [0.0, 4.314579, 4.57551, 6.41941]
    assert [s.rid for s in specs] == [0, 1, 2, 3]
    assert len(load_trace(DATA / "azure_sample.csv", limit=2)) == 2


def test_azure_columns_in_another_order_and_seconds():
    text = "GeneratedTokens,ContextTokens,TIMESTAMP\n5,10,100.5\n6,20,101.0\n"
    assert [(s.arrival, s.prompt_len, s.output_len) for s in parse_trace(text)] == [(0.0, 10, 5), (0.5, 20, 6)]


def test_plain_csv_without_header():
    assert [(s.arrival, s.prompt_len) for s in parse_trace("# comment\n1.0,5,6\n\n3.0,7,8\n")] == [(0.0, 5), (2.0, 7)]


@pytest.mark.parametrize(("text", "message"), [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47,abc,5\n",
     "t.csv:3: prompt tokens 'abc' is not an integer"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,374\n", "t.csv:2: expected 3 fields, got 2"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:15:46,374,4\n", "t.csv:2: timestamp '2023-13-16"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,4\n", "t.csv:2: prompt tokens must be >= 1"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,-1\n", "t.csv:2: output tokens must be >= 0"),
    ("1.0,5,6\n0.5,5,6\n", "t.csv:2: arrival 0.5 is before the previous row's"),
    ("when,prompt,out\n1,2,3\n", "t.csv:1: unknown header"),
    ("# nothing\n", "t.csv: no requests"),
])
def test_bad_rows_name_the_line(text, message):
    with pytest.raises(TraceError) as err:
        parse_trace(text, "t.csv")
    assert message in str(err.value)


def test_missing_file():
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(DATA / "nope.csv")


def test_lengths():
    import random
    rng = random.Random(0)
    assert LengthDist.parse("7").draw(rng) == 7
    assert {LengthDist.parse("uniform:3:4").draw(rng) for _ in range(50)} == {3, 4}
    draws = [LengthDist.parse("lognormal:200:0.5:10000").draw(rng) for _ in range(4000)]
    assert 185 < statistics.mean(draws) < 215
    for bad in ("0", "uniform:5:2", "gauss:1:2", "x"):
        with pytest.raises(TraceError, match="bad length spec"):
            LengthDist.parse(bad)


def test_gamma_burstiness_and_rate():
    gaps = []
    last = 0.0
    for s in synthetic(Workload(arrivals="gamma", rate=10, cv=3), 20000, 5):
        gaps.append(s.arrival - last)
        last = s.arrival
    mean = statistics.mean(gaps)
    assert 0.09 < mean < 0.11
    assert 2.7 < statistics.pstdev(gaps) / mean < 3.3


def test_prefix_groups_and_offline_fraction():
    specs = list(synthetic(Workload(prompt="uniform:10:400", prefix_groups=4, prefix_len=100,
                                    offline_fraction=0.25), 4000, 1))
    assert {s.prefix_group for s in specs} == {0, 1, 2, 3}
    assert all(s.prefix_len == min(100, s.prompt_len - 1) for s in specs)
    counts = [sum(s.prefix_group == g for s in specs) for g in range(4)]
    assert counts == sorted(counts, reverse=True)  # Zipf-like popularity
    assert 0.22 < sum(s.offline for s in specs) / len(specs) < 0.28


def test_phases_alternate_the_length_mix_by_arrival_time():
    """10 s prefill-heavy, 20 s decode-heavy, fixed lengths: each request has its arrival phase's mix
    (oracle: arrival mod 30 < 10), both phases occur several times, arrivals are the gamma ones."""
    w = Workload(arrivals="phases", rate=20, cv=3, phase_s=(10.0, 20.0), prefill_mix=("1000", "8"),
                 decode_mix=("50", "300"))
    specs = list(synthetic(w, 6000, 2))
    for s in specs:
        assert (s.prompt_len, s.output_len) == ((1000, 8) if s.arrival % 30 < 10 else (50, 300))
    assert len({int(s.arrival // 30) for s in specs if s.prompt_len == 1000}) >= 5
    assert len({int(s.arrival // 30) for s in specs if s.prompt_len == 50}) >= 5
    gamma = synthetic(Workload(arrivals="gamma", rate=20, cv=3), 6000, 2)
    assert [s.arrival for s in specs] == [s.arrival for s in gamma]
    assert [w.phase_of(t) for t in (0.0, 9.99, 10.0, 29.99, 30.0, 45.0)] == [0, 0, 1, 1, 0, 1]


def test_phases_draw_each_mix_distribution_and_are_deterministic():
    w = Workload(arrivals="phases", rate=50, cv=2, phase_s=(5.0, 5.0),
                 prefill_mix=("lognormal:2000:0.3", "uniform:1:10"), decode_mix=("uniform:20:40", "lognormal:400:0.3"))
    specs = list(synthetic(w, 8000, 7))
    heavy = [s for s in specs if w.phase_of(s.arrival) == 0]
    light = [s for s in specs if w.phase_of(s.arrival) == 1]
    assert 1900 < statistics.mean(s.prompt_len for s in heavy) < 2100
    assert {s.output_len for s in heavy} == set(range(1, 11))
    assert {s.prompt_len for s in light} == set(range(20, 41))
    assert 380 < statistics.mean(s.output_len for s in light) < 420
    assert list(synthetic(w, 500, 7)) == specs[:500]
    assert list(synthetic(w, 500, 8)) != specs[:500]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"phase_s": (0.0, 10.0)}, "phase_s must be two durations > 0"),
    ({"phase_s": (10.0,)}, "phase_s must be two durations > 0"),
    ({"prefill_mix": ("lognormal:100", "8")}, "bad length spec 'lognormal:100'"),
    ({"decode_mix": ("50",)}, "decode_mix must be (prompt spec, output spec)"),
    ({"arrivals": "tidal"}, "arrivals must be one of poisson, gamma, phases"),
])
def test_bad_phase_settings_are_named(kwargs, message):
    with pytest.raises(TraceError) as err:
        Workload(**{"arrivals": "phases", **kwargs}).check()
    assert message in str(err.value)
