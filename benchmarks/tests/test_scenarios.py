import pathlib

import pytest

from benchmarks.scenarios import ALL, Settings, plan, sweep_point_requests
from benchmarks.suite import SCENARIO


def test_plan_groups_each_server_once_per_dtype():
    s = Settings(model_dir=pathlib.Path("m"), out_dir=pathlib.Path("o"))
    steps = plan(list(ALL), s)
    assert ("xllm", "bfloat16", ["batch1", "concurrency", "sweep"]) in steps
    assert ("xllm", "float32", ["batch1"]) in steps
    assert ("llamacpp", "bfloat16", ["batch1"]) in steps          # llama.cpp: batch 1 only
    assert ("hf", "bfloat16", ["batch1", "concurrency"]) in steps  # HF: offline, no sweep
    assert len(steps) == len(set((a, b) for a, b, _ in steps))
    only = plan(["concurrency"], Settings(model_dir=pathlib.Path("m"), out_dir=pathlib.Path("o"),
                                          systems=["xllm", "llamacpp"], dtypes=["float32"]))
    assert only == [("xllm", "float32", ["concurrency"])]


def test_cli_parses_scenarios_and_rejects_unknown_systems():
    args = SCENARIO.parser().parse_args(["batch1", "sweep", "--systems", "xllm,vllm", "--concurrency", "4,8"])
    assert args.scenarios == ["batch1", "sweep"] and args.systems == ["xllm", "vllm"] and args.concurrency == [4, 8]
    with pytest.raises(SystemExit):
        SCENARIO.parser().parse_args(["batch1", "--systems", "tgi"])
    with pytest.raises(SystemExit):
        SCENARIO.parser().parse_args(["nothing"])


def test_sweep_point_requests_scale_with_rate():
    assert sweep_point_requests(0.1, 64, 60) == 16      # never fewer than 16
    assert sweep_point_requests(0.5, 64, 60) == 30
    assert sweep_point_requests(10, 64, 60) == 64       # never more than asked
    assert sweep_point_requests(0.1, 8, 60) == 8


def test_cpu_busy_fraction_is_a_fraction():
    from benchmarks.machine import cpu_busy_fraction, machine_info

    busy = cpu_busy_fraction(0.05)
    assert busy is None or 0.0 <= busy <= 1.0
    assert machine_info()["logical_cpus"] >= 1
