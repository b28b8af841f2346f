"""The chaos soak: its accounting (a changed, repeated or missing character, a lost request, a 5xx and
a slow request inside a fault window are each counted against the right fault) and one quick run on
the smallest setup (etcd, two engines, two gateways; SIGSTOP and hostile clients) whose report has the
harness's shape."""

from __future__ import annotations

import json

import pytest

from benchmarks.chaos import OUTSIDE, SCENARIO, account, goal_met, judge, summary
from xllm.testing.sse import CompletionStream as Stream

T0 = 100.0  # the load's start (time.monotonic())


def _got(text: str, start: float, took: float = 0.5, status: int = 200, finish: str = "length",
         tokens: list[str] | None = None, top: list[dict] | None = None) -> Stream:
    return Stream(status=status, text=text, tokens=tokens or list(text), top=top or [],
                  finish=[finish] if status == 200 else [], usage={"completion_tokens": len(tokens or text)},
                  done_at=T0 + start + took, arrivals=[T0 + start + took / 4])


REF = _got("abcd", 0.0, top=[{"a": -0.1, "x": -3.0}, {"b": -0.5, "y": -0.5004}, {"c": -1.0, "z": -2.0},
                            {"d": -1.0, "w": -2.0}])
WINDOWS = [{"fault": "sigkill", "at": 10.0, "until": 12.0}, {"fault": "etcd", "at": 20.0, "until": None}]


def test_the_accounting_counts_each_difference_against_the_fault_it_overlaps():
    outcomes = [
        judge(_got("abcd", 1.0), REF, True, 4, 1.0, T0),                     # outside, clean
        judge(_got("abcd", 2.0, took=0.2), REF, False, 4, 2.0, T0),           # outside, clean
        judge(_got("abXd", 9.8), REF, False, 4, 9.8, T0),                    # sigkill: one character changed
        judge(_got("abccd", 11.0, tokens=list("abcd")), REF, False, 4, 11.0, T0),  # sigkill: one repeated
        judge(_got("ab", 11.5, tokens=list("ab")), REF, False, 4, 11.5, T0),       # sigkill: lost (2 tokens)
        judge(_got("aycd", 11.0), REF, True, 4, 11.0, T0),                   # sigkill: greedy near-tie
        judge(_got("", 21.0, status=503), REF, False, 4, 21.0, T0),           # etcd: a 5xx, lost
        judge(_got("abcd", 22.0, took=4.0), REF, True, 4, 22.0, T0),          # etcd: clean but slow
    ]
    rows = {r["fault"]: r for r in account(outcomes, WINDOWS)}
    assert list(rows) == [OUTSIDE, "sigkill", "etcd"]
    out, kill, etcd = rows[OUTSIDE], rows["sigkill"], rows["etcd"]
    assert (out["requests"], out["lost"], out["changed_requests"], out["c5xx"]) == (2, 0, 0, 0)
    assert (kill["requests"], kill["lost"], kill["changed_requests"], kill["missing_chars"], kill["extra_chars"],
            kill["near_ties"], kill["c5xx"]) == (4, 1, 2, 1, 2, 1, 0)
    assert (etcd["requests"], etcd["lost"], etcd["c5xx"]) == (2, 1, 1)
    assert etcd["e2e_s"]["p95"] == pytest.approx(4.0)
    assert etcd["inflation"]["e2e_s"]["p95"] == pytest.approx(4.0 / out["e2e_s"]["p95"])
    results = {"rows": list(rows.values()), "windows": [{**w, "problems": []} for w in WINDOWS]}
    assert not goal_met(results)
    clean = {"rows": [out], "windows": []}
    assert goal_met(clean)
    assert not goal_met({"rows": [out], "windows": [{"problems": ["the fault failed"]}]})
    assert not goal_met({"rows": [], "windows": [], "errors": {"soak": "RuntimeError: etcd did not start"}})


def test_a_quick_soak_reports_every_fault_in_the_harness_shape(tmp_path):
    from xllm.testing.processes import ensure_etcd

    ensure_etcd()
    code = SCENARIO.main(["--quick", "--faults", "sigstop,hostile", "--out", str(tmp_path), "--no-plots"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0, results["errors"]
    assert [r["fault"] for r in results["rows"]] == [OUTSIDE, "sigstop", "hostile"]
    assert [w["fault"] for w in results["windows"]] == ["sigstop", "hostile"]
    assert all(w["until"] is not None and w["until"] >= w["at"] for w in results["windows"])
    assert results["windows"][1]["details"]["sent"] > 0
    assert results["requests"] and set(results["requests"][0]) >= {"start", "end", "ttft", "status", "lost"}
    assert sum(r["requests"] for r in results["rows"]) >= len(results["requests"])
    assert set(results["skipped"]) >= {"network delay and loss", "full disk"}
    text = (tmp_path / "summary.md").read_text()
    assert text == summary(results) and "| sigstop | 1 |" in text


def test_the_etcd_relay_carries_bytes_both_ways():
    import socket
    import threading

    from benchmarks.chaos_net import Relay

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def echo() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(conn.recv(100).upper())

        threading.Thread(target=echo, daemon=True).start()
        relay = Relay("127.0.0.2", port).start()  # another loopback address, etcd's port
        try:
            with socket.create_connection(("127.0.0.2", port), timeout=10) as c:
                c.sendall(b"lease keepalive")
                assert c.recv(100) == b"LEASE KEEPALIVE"
        finally:
            relay.stop()
