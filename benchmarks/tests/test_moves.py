"""The moves benchmark's pure parts: pauses from chunk arrival times, where a stream parts from its
reference (and whether tokens were lost or repeated), the gateway's move figures from two scrapes,
the log lines, the per-context comparison (ratio, auto's choice), the tables and the plot."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest

from benchmarks.metrics import parse
from benchmarks.movecells import (
    Cell,
    TimedStream,
    _check,
    decisions,
    divergence,
    handed_back,
    migration_lines,
    move_figures,
    move_index,
    moved_pauses_ms,
    pause_after,
    shifted,
)
from benchmarks.moves import SCENARIO, chosen_way, comparisons, markdown, pause_stats, plot


def test_pause_is_the_largest_gap_ending_after_the_fault():
    arrivals = [0.0, 0.1, 0.2, 1.5, 1.6, 1.65]  # a move between 0.2 and 1.5
    assert pause_after(arrivals, 0.15) == pytest.approx(1.3)
    assert move_index(arrivals, 0.15) == 3
    assert pause_after(arrivals, 1.55) == pytest.approx(0.1)  # gaps ending before the fault do not count
    assert pause_after(arrivals, 2.0) is None and move_index(arrivals, 2.0) is None
    assert pause_after([1.0], 0.0) is None


def test_moved_pauses_only_count_streams_that_started_on_the_victim():
    got = [TimedStream(instance="e0", arrivals=[0.0, 1.0, 3.0]), TimedStream(instance="e1", arrivals=[0.0, 5.0]),
           TimedStream(instance="e0", arrivals=[0.0, 0.2])]  # ended before the fault: no pause
    assert moved_pauses_ms(got, "e0", 0.5) == [pytest.approx(2000.0)]


def _stream(tokens: list[str], top: list[dict] | None = None) -> TimedStream:
    return TimedStream(status=200, text="".join(tokens), tokens=tokens, top=top or [{}] * len(tokens))


REF = [f"t{i}" for i in range(20)]


@pytest.mark.parametrize(("got", "want"), [
    (REF[:5] + REF[6:] + ["x"], 1),             # one token lost at 5 (the stream then makes one more at the end)
    (REF[:5] + REF[8:] + ["x", "y", "z"], 3),   # three lost
    (REF[:5] + REF[4:19], -1),                  # token 4 repeated
    ([*REF[:5], "a", "b", *REF[7:]], None),     # went on differently (two tokens replaced, then the same again)
    (REF[:5] + [f"u{i}" for i in range(15)], None),
])
def test_shifted_tells_lost_or_repeated_tokens_from_a_different_continuation(got, want):
    j = next(k for k, (a, b) in enumerate(zip(got, REF)) if a != b)
    assert shifted(got, REF, j) == want


def test_divergence_reports_where_and_the_reference_margin_there():
    top = [{f"t{i}": -0.1, "z": -3.0} for i in range(20)]
    top[7] = {"t7": -0.50, "q": -0.55}
    ref = _stream(REF, top)
    got = _stream(REF[:7] + ["q"] + [f"v{i}" for i in range(12)])
    d = divergence(got, ref)
    assert d["token"] == 7 and d["margin"] == pytest.approx(0.05) and d["got_in_ref_top2"] and d["shift"] is None
    assert divergence(ref, ref) is None


def _samples(moves: dict, installed: float, pauses: list[float], resumed: float = 0.0) -> dict:
    bounds = (0.1, 0.5, 1.0, math.inf)
    lines = [f'xllm:request_moves_total{{model_name="tiny",how="{h}"}} {n}' for h, n in moves.items()]
    lines.append(f'xllm:kv_migrations_total{{model_name="tiny",instance="e1",outcome="installed"}} {installed}')
    lines.append(f'xllm:router_resumed_requests_total{{model_name="tiny",instance="e0"}} {resumed}')
    for le in bounds:
        n = sum(1 for p in pauses if p <= le)
        le_text = "+Inf" if math.isinf(le) else str(le)
        lines.append(f'xllm:request_move_pause_seconds_bucket{{model_name="tiny",how="migrated",le="{le_text}"}} {n}')
    lines.append(f'xllm:request_move_pause_seconds_count{{model_name="tiny",how="migrated"}} {len(pauses)}')
    lines.append(f'xllm:request_move_pause_seconds_sum{{model_name="tiny",how="migrated"}} {sum(pauses)}')
    header = ["# TYPE xllm:request_moves counter", "# TYPE xllm:kv_migrations counter",
              "# TYPE xllm:router_resumed_requests counter", "# TYPE xllm:request_move_pause_seconds histogram"]
    return parse("\n".join(header + lines) + "\n")


def test_move_figures_are_deltas_between_two_scrapes():
    before = _samples({"migrated": 2}, 2, [0.05, 0.2])
    after = _samples({"migrated": 5, "recomputed": 1}, 5, [0.05, 0.2, 0.05, 0.3, 0.7], resumed=2)
    f = move_figures(before, after)
    assert f.moves == {"migrated": 3.0, "recomputed": 1.0} and f.moved == 4
    assert f.migrations == {"installed": 3.0} and f.resumed == 2.0
    p = f.pause["migrated"]
    assert p["count"] == 3 and p["mean_ms"] == pytest.approx(350.0) and p["max_under_ms"] == pytest.approx(1000.0)


GATEWAY_LOG = """\
2026-11-22 21:33:01 INFO xllm.gateway.moves: moving cmpl-ab12 off engine-0: 1541 tokens, 36175872 KV bytes; \
transfer 180.9 ms vs recompute 3760.2 ms: migrating to engine-1
2026-11-22 21:33:01 INFO xllm.gateway.moves: moving cmpl-cd34 off engine-0: 133 tokens, 100 KV bytes; \
transfer 0.0 ms vs recompute unknown: recomputing elsewhere
2026-11-22 21:33:02 INFO xllm.engine.handoff.migration: migrated cmpl-ab12#1 to 127.0.0.1:4000 over fd: 36175872 \
bytes, 96 block(s) while it ran, 1 after it stopped (3 token(s) appended); 780.4 ms in all, 107.2 ms stopped
2026-11-22 21:33:03 INFO xllm.engine.instance: instance engine-0 stopped (2 request(s) handed back)
"""


def test_log_lines_give_predictions_migrations_and_hand_backs():
    d = decisions(GATEWAY_LOG)
    assert [(x["tokens"], x["transfer_ms"], x["recompute_ms"], x["choice"]) for x in d] == [
        (1541, 180.9, 3760.2, "migrate"), (133, 0.0, None, "recompute")]
    m = migration_lines(GATEWAY_LOG)
    assert [(x["transport"], x["bytes"], x["total_ms"], x["stopped_ms"]) for x in m] == [("fd", 36175872, 780.4,
                                                                                           107.2)]
    assert handed_back(GATEWAY_LOG, "engine-0") == 2 and handed_back(GATEWAY_LOG, "engine-1") is None


def _cell(context: int, mode: str, pauses: list[float], moves: dict, **kw) -> dict:
    c = Cell(context, mode, 8, 128, victim="engine-0", on_victim=4, moves=moves, pauses_ms=pauses,
             bystander_gaps_ms=[40.0] * 4, reference_gap_ms=30.0, complete=8, **kw)
    return asdict(c)


CELLS = [
    _cell(128, "migrate", [50.0, 60.0, 70.0, 80.0], {"migrated": 4}, migrations={"installed": 4}),
    _cell(128, "recompute", [100.0, 110.0, 120.0, 130.0], {"recomputed": 4}),
    _cell(128, "auto", [90.0, 100.0, 110.0, 120.0], {"recomputed": 3, "migrated": 1}),
    _cell(128, "off", [200.0] * 4, {}, resumed=4, handed_back=4),
    _cell(1536, "migrate", [300.0, 350.0, 400.0, 450.0], {"migrated": 4}, migrations={"installed": 4}),
    _cell(1536, "recompute", [9000.0, 11000.0, 12000.0, 14000.0], {"recomputed": 4}),
    _cell(1536, "auto", [320.0, 360.0, 380.0, 420.0], {"migrated": 4}, migrations={"installed": 4}),
]


def test_comparison_gives_the_ratio_and_whether_auto_took_the_faster_way():
    rows = {r["context"]: r for r in comparisons(CELLS)}
    small, large = rows[128], rows[1536]
    assert small["migrate_p50_ms"] == pytest.approx(65.0) and small["recompute_p50_ms"] == pytest.approx(115.0)
    assert small["ratio"] == pytest.approx(115 / 65) and small["off_p50_ms"] == pytest.approx(200.0)
    assert (small["auto_chose"], small["faster"], small["auto_right"]) == ("recompute", "migrate", False)
    assert large["ratio"] == pytest.approx(11500 / 375)
    assert (large["auto_chose"], large["faster"], large["auto_right"]) == ("migrate", "migrate", True)
    assert large["off_p50_ms"] is None


def test_pause_stats_and_chosen_way():
    assert pause_stats([]) == {"n": 0, "p50": None, "p90": None, "max": None}
    s = pause_stats([10.0, 20.0, 30.0])
    assert (s["n"], s["p50"], s["max"]) == (3, 20.0, 30.0) and s["p90"] == pytest.approx(28.0)
    assert chosen_way({}) == "none"
    assert chosen_way({"migrated": 2, "recomputed": 2}) == "migrate"
    assert chosen_way({"migrated": 1, "migration_failed": 2}) == "recompute"  # failed ones were recomputed


def test_a_cell_fails_on_lost_tokens_failed_migrations_or_no_move():
    ok = Cell(128, "migrate", 8, 128, moves={"migrated": 4}, complete=8)
    _check(ok, exact=True)
    assert ok.problems == []
    bf16 = Cell(128, "recompute", 8, 128, moves={"recomputed": 4}, complete=8, differing=2, lost_chars=50,
                diverged=[{"stream": 1, "shift": None, "token": 9}])
    _check(bf16, exact=False)  # bfloat16: a different continuation is not a failure ...
    assert bf16.problems == []
    _check(bf16, exact=True)   # ... in float32 it is
    assert len(bf16.problems) == 1
    lost = Cell(128, "auto", 8, 128, moves={"migrated": 4}, complete=8, diverged=[{"stream": 3, "shift": 1,
                                                                                     "token": 12}])
    _check(lost, exact=False)
    assert lost.problems == ["1 streams lost or repeated tokens: stream 3: 1 lost at token 12"]
    failed = Cell(128, "auto", 8, 128, moves={"migrated": 3, "migration_failed": 1}, complete=8)
    _check(failed, exact=True)
    assert any("migrations failed" in p for p in failed.problems)
    forced = Cell(128, "migrate", 8, 128, moves={"recomputed": 4}, complete=8)
    _check(forced, exact=True)
    assert forced.problems == ["--drain-moves migrate, yet 4 recomputed"]
    off = Cell(128, "off", 8, 128, complete=8)
    _check(off, exact=True)
    assert off.problems == ["nothing was handed back: every stream finished within the drain timeout"]
    none = Cell(128, "auto", 8, 128, complete=7)
    _check(none, exact=True)
    assert none.problems == ["1 streams incomplete", "no stream moved"]


META = {"model": "tiny", "dtype": "bfloat16", "timestamp": "20261123-000000", "streams": 8, "output_len": 128,
        "routing": "round_robin", "off_drain_timeout": 1.0, "machine": {}}


def test_markdown_has_a_row_per_cell_and_a_row_per_context():
    md = markdown(CELLS, META, {"512/off": "RuntimeError: boom"})
    assert md.count("| 128 | ") == 4 + 1 and md.count("| 1536 | ") == 3 + 1
    assert "| 128 | recompute | 4 of 8 | 4 recomputed | 0 / 0 | 115 / 127 / 130 |" in md
    assert "| 1536 | 375 | 11500 | 30.7x | – | migrate (4 migrated) | 370 | migrate | yes |" in md
    assert "| 128 | 65 | 115 | 1.8x | 200 | recompute (1 migrated, 3 recomputed) | 105 | migrate | **no** |" in md
    assert "4 handed back at the drain timeout" in md
    assert "**512/off did not run to the end**: RuntimeError: boom" in md
    assert "only tokens lost or repeated fail a row" in md


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    plot(CELLS, tmp_path / "moves.png")
    assert (tmp_path / "moves.png").read_bytes()[:4] == b"\x89PNG"


def test_command_line_parses_lists_and_rejects_unknown_modes():
    args = SCENARIO.parser().parse_args(["--contexts", "64,256", "--modes", "off,migrate"])
    assert args.contexts == [64, 256] and args.modes == ["migrate", "off"]  # always in the table's order
    with pytest.raises(SystemExit):
        SCENARIO.parser().parse_args(["--modes", "teleport"])
    with pytest.raises(SystemExit):
        SCENARIO.parser().parse_args(["--contexts", "0"])
