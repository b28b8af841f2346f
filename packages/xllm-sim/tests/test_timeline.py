"""``xllm-sim run --timeline S``: the run's timeline the gateway's live cluster page replays
(``/dashboard?replay``): frames of every instance's role, load and KV use at a steady interval, and the
role flips and moves with the keys the live gateway publishes them with, consistent with the report."""

from __future__ import annotations

import itertools
import json

from xllm.sim.cli import main

POOLS = {"prefill", "decode", "prefill_to_decode", "decode_to_prefill"}


def test_a_dynamic_pd_run_writes_a_replayable_timeline(tmp_path):
    out = tmp_path / "run.json"
    assert main(["run", "--prefill-instances", "4", "--decode-instances", "12", "--pd-policy", "dynamic",
                 "--slo-ttft-ms", "1500", "--slo-tpot-ms", "100", "--pd-flip-window", "1", "--pd-flip-cooldown", "2",
                 "--pd-cluster-cooldown", "1", "--trace", "phases", "--phase-s", "6,6", "--rate", "40",
                 "--requests", "600", "--timeline", "0.5", "--json", str(out), "--no-progress"]) == 0
    r = json.loads(out.read_text())
    tl = r["timeline"]
    n = len(tl["instances"])
    assert tl["interval_s"] == 0.5 and tl["instances"] == [i["instance_id"] for i in r["instances"]] and n == 16
    frames = tl["frames"]
    times = [f["t"] for f in frames]
    assert times == sorted(times) and times[0] == 0 and times[-1] >= r["duration_s"] - 1e-6
    assert all(b - a <= 0.5 + 1e-9 for a, b in itertools.pairwise(times))
    for f in frames:
        assert len(f["role"]) == len(f["running"]) == len(f["waiting"]) == len(f["kv"]) == n
        assert set(f["role"]) <= POOLS and all(0 <= k <= 1 for k in f["kv"])
    assert frames[-1]["finished"] == frames[-1]["arrived"] == r["completed"] == 600
    assert any(f["ttft_p50"] is not None for f in frames) and any(f["tpot_p99"] is not None for f in frames)
    assert sum(f["running"][i] for f in frames for i in range(n)) > 0
    kinds = [e["kind"] for e in tl["events"]]
    assert kinds.count("role_flip_started") == r["role_flips"] >= 1
    assert kinds.count("move_started") == kinds.count("move_finished") == r["moves"]
    first = next(e for e in tl["events"] if e["kind"] == "role_flip_started")
    assert {"t", "instance", "from_role", "to_role", "trigger", "reason"} <= set(first) and first["reason"]
    # a flip under way shows in the frames between its start and its end
    end = next((e for e in tl["events"] if e["kind"] == "role_flip_finished" and e["instance"] == first["instance"]),
               None)
    idx = tl["instances"].index(first["instance"])
    during = [f["role"][idx] for f in frames if first["t"] < f["t"] < (end["t"] if end else float("inf"))]
    assert all(p == f"{first['from_role']}_to_{first['to_role']}" for p in during)
    assert r["events"] > 0 and json.loads(out.read_text()) == r


def test_without_the_flag_the_report_has_no_timeline(tmp_path):
    out = tmp_path / "run.json"
    assert main(["run", "--instances", "2", "--requests", "20", "--json", str(out), "--no-progress"]) == 0
    assert "timeline" not in json.loads(out.read_text())
