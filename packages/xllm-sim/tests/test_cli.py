"""``xllm-sim``: flags, JSON output, errors, the shipped profile."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from xllm.sched.latency import PerfProfile
from xllm.sim.cli import build_parser, main
from xllm.sim.profile import DEFAULT_PROFILE, write_provisional

DATA = pathlib.Path(__file__).parent / "data"


def test_every_flag_has_help():
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    missing = [a.dest for a in run._actions if not a.help]
    assert missing == []


def test_run_writes_json(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    write_provisional(profile)
    out = tmp_path / "r.json"
    records = tmp_path / "r.jsonl"
    assert main(["run", "--instances", "3", "--requests", "200", "--trace", "gamma", "--rate", "5", "--cv", "2",
                 "--policy", "least-load", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100", "--json", str(out),
                 "--records", str(records), "--no-progress", "--prefix-groups", "3", "--prefix-len", "64",
                 "--profile", str(profile)]) == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 200 and r["config"]["routing"] == "least_load"
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert set(r[key]) >= {"p50", "p90", "p99"}
    assert {"slo_attainment", "goodput", "role_flips", "offline", "instances", "utilisation"} <= set(r)
    assert len(r["instances"]) == 3 and r["profile"]["path"] == str(profile) and r["profile"]["provisional"]
    assert len(records.read_text().splitlines()) == 200
    assert "200/200 requests" in capsys.readouterr().out


def test_pd_run_from_an_azure_trace(tmp_path):
    out = tmp_path / "pd.json"
    assert main(["run", "--prefill-instances", "1", "--decode-instances", "1", "--trace",
                 str(DATA / "azure_sample.csv"), "--rate", "2", "--json", str(out), "--no-progress"]) == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 4 and r["kv_transfer_bytes"] > 0
    assert {i["role"] for i in r["instances"]} == {"prefill", "decode"}


def test_errors_are_clear(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,12,x\n")
    assert main(["run", "--trace", str(bad), "--no-progress"]) == 2
    assert f"{bad}:2: output tokens 'x' is not an integer" in capsys.readouterr().err
    assert main(["run", "--prefill-instances", "1", "--decode-instances", "1", "--pd-policy", "dynamic",
                 "--no-progress"]) == 2
    assert "slo_ttft_s" in capsys.readouterr().err


def test_shipped_profile_loads_and_console_script_runs():
    profile = PerfProfile.load(DEFAULT_PROFILE)
    assert len(profile.samples) >= 10 and profile.fit().step_seconds is not None
    out = subprocess.run([sys.executable, "-m", "xllm.sim", "policies"], capture_output=True, text=True, check=True)
    assert "--pd-policy: static, dynamic" in out.stdout
    code = "import sys, xllm.sim.cli; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_phases_trace_flags(tmp_path, capsys):
    out = tmp_path / "p.json"
    records = tmp_path / "p.jsonl"
    assert main(["run", "--prefill-instances", "1", "--decode-instances", "2", "--trace", "phases", "--rate", "3",
                 "--requests", "60", "--phase-s", "4,6", "--prefill-mix", "300,2", "--decode-mix", "20,40",
                 "--json", str(out), "--records", str(records), "--no-progress"]) == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 60 and r["workload"]["phase_s"] == [4.0, 6.0]
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert all((x["prompt_len"], x["output_len"]) == ((300, 2) if x["arrival"] % 10 < 4 else (20, 40)) for x in rows)
    assert {x["prompt_len"] for x in rows} == {300, 20}
    for flags, message in ((["--phase-s", "0"], "--phase-s: expected S or P,D (seconds > 0), got '0'"),
                           (["--phase-s", "a,b"], "--phase-s: expected S or P,D"),
                           (["--prefill-mix", "300"], "--prefill-mix: expected PROMPT,OUTPUT"),
                           (["--decode-mix", "x,5"], "--decode-mix: bad length spec 'x'")):
        try:
            main(["run", "--trace", "phases", "--no-progress", *flags])
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"{flags} accepted")
        assert message in capsys.readouterr().err
