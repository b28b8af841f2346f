"""The lora_kernel scenario run quick (tiny shapes, a few repetitions): the report's shape (a cell per
projection, rank, rows and adapters with each candidate's percentiles and the ratios), its table and plot."""

from __future__ import annotations

import json

from benchmarks import lora_kernel
from benchmarks.cli import main
from xllm.kernels import native


def test_quick_run_writes_the_report(tmp_path):
    assert main(["lora_kernel", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    cells = results["cells"]
    assert [(c["projection"], c["rank"], c["rows"], c["adapters"]) for c in cells] == [
        (p, 4, t, n) for p in lora_kernel.QUICK for t, n in ((1, 1), (5, 1), (5, 3))]  # (T=1 has one adapter)
    with_native = native.unavailable_reason() is None
    for c in cells:
        assert c["distinct"] == min(c["rows"], c["adapters"])
        assert set(c["us"]) == ({"native", "torch_loop", "base"} if with_native else {"torch_loop", "base"})
        for u in c["us"].values():
            assert 0 < u["best"] <= u["p10"] <= u["p50"] <= u["p90"]
        assert ("torch_over_native" in c) == with_native and c["torch_over_base"] > 0
    text = (tmp_path / "summary.md").read_text()
    assert text.count("\n| qkv | 4 |") == 3 and text.count("\n| down | 4 |") == 3
    assert (tmp_path / "lora_kernel.png").stat().st_size > 1000
    assert main(["lora_kernel", "--report", str(tmp_path), "--no-plots"]) == 0
