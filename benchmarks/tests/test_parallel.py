"""The parallel scenario's pure parts: the servers' command lines (TP flags, vLLM's per-rank core
binding), which systems a model's heads allow, the report's tables and plot. No servers."""

from __future__ import annotations

import json

from benchmarks import parallel


def _run(tput: float, tpot: float) -> dict:
    return {"metrics": {"output_throughput": tput, "ttft_ms": {"p50": 50.0, "p99": 90.0},
                        "tpot_ms": {"p50": tpot, "p99": tpot * 1.5}}}


def test_server_command_lines(tmp_path, monkeypatch):
    from benchmarks.peers import vllm

    monkeypatch.setattr(vllm, "install", lambda: type("V", (), {"python": "python"})())
    args = parallel.SCENARIO.parser().parse_args(["--threads", "2"])
    xllm_tp2 = parallel.start("xllm-tp2-gloo", tmp_path, args, tmp_path)
    cmd = xllm_tp2.cmd
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and cmd[cmd.index("--tp-comm") + 1] == "gloo"
    assert cmd[cmd.index("--threads") + 1] == "1"  # each rank half the cores
    assert "--tensor-parallel-size" not in parallel.start("xllm-tp1", tmp_path, args, tmp_path).cmd
    v2 = parallel.start("vllm-tp2", tmp_path, args, tmp_path)
    assert v2.cmd[v2.cmd.index("--tensor-parallel-size") + 1] == "2"
    assert v2.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


def test_heads_divide(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3}))
    assert not parallel.heads_divide(tmp_path, 2)
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 14, "num_key_value_heads": 2}))
    assert parallel.heads_divide(tmp_path, 2)


def test_report_tables_ratios_and_plot(tmp_path):
    results = {
        "meta": {"machine": {"cpu_model": "AMD EPYC"}},
        "allreduce": {"rows": [{"rows": 1, "hidden": 576, "shm_us_p50": 10.0, "gloo_us_p50": 1000.0},
                               {"rows": 16, "hidden": 576, "shm_us_p50": 20.0, "gloo_us_p50": 1100.0}]},
        "runs": {"smollm2": {"xllm-tp1": {"c1": _run(40.0, 25.0), "c16": _run(300.0, 50.0)},
                             "xllm-tp2-shm": {"c1": _run(38.0, 26.0), "c16": _run(290.0, 52.0)}}},
        "skipped": {"smollm2/vllm-tp2": "heads"}, "errors": {"qwen05/vllm-tp2": "RuntimeError: boom"},
    }
    md = parallel.markdown(results)
    assert "(AMD EPYC)" in md
    assert "| 1x576 | 10.0 | 1,000 | 100 |" in md
    # TP=2 shm at batch 1: 38 / 40 of TP=1; the all-reduce's share: 2 x 30 layers x 10 us over 26 ms
    assert "| 1 | xllm-tp2-shm | 38.0 | 0.95 |" in md
    assert md.split("| 1 | xllm-tp2-shm |")[1].split("\n")[0].rstrip().endswith("| 2% |")
    assert "skipped smollm2/vllm-tp2" in md and "**error** qwen05/vllm-tp2" in md
    parallel.plot(results, tmp_path)
    assert (tmp_path / "parallel.png").stat().st_size > 0


def test_step_split_runs_both_ways_on_two_ranks(tmp_path):
    """The in-process step measurement's quick mode on a tiny random Llama (the figures mean nothing here):
    every comm and shape has both ways' step times and all-reduce shares."""
    import torch
    import transformers

    from benchmarks.parallel_steps import step_split
    from xllm.core.parallel.shm import ShmComm
    from xllm.testing.models import save_random_hf_model

    cfg = transformers.LlamaConfig(vocab_size=501, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                                   max_position_embeddings=128)
    save_random_hf_model(tmp_path / "tiny", cfg, seed=0)
    out = step_split(str(tmp_path / "tiny"), torch.float32, shapes={"decode 4": (1,) * 4, "mixed": (1, 1, 9)},
                     iters=2, warmup=1)
    comms = ["shm", "gloo"] if ShmComm.available() else ["gloo"]
    assert [(r["comm"], r["shape"]) for r in out["rows"]] == [(c, s) for c in comms for s in ("decode 4", "mixed")]
    for r in out["rows"]:
        assert r["plain_ms"] > 0 and r["overlap_ms"] > 0 and r["speedup"] > 0
        assert 0 < r["plain_comm_share"] < 1 and 0 <= r["overlap_comm_share"] < 1
    md = parallel.markdown({"steps": out})
    assert "| gloo | mixed | 11 |" in md
    parallel.plot({"steps": out}, tmp_path)
    assert (tmp_path / "parallel-steps.png").stat().st_size > 0
