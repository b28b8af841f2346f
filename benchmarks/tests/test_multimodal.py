"""``python -m benchmarks multimodal`` end to end on the tiny random Qwen2-VL (made in a temporary cache): every
configuration serves every request, the phase-on runs encode every image in the encode phase and the phase-off
run none there, and the report has its table and plot. Figures are not checked (timings)."""

from __future__ import annotations

import json

from benchmarks.cli import main


def test_a_tiny_run_reports_each_configuration(tmp_path, monkeypatch):
    monkeypatch.setenv("XLLM_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    rc = main(["multimodal", "--model-size", "tiny", "--requests", "6", "--rate", "50", "--image-size", "56",
               "--tokens", "3", "--image-fraction", "0.5", "--max-encode-images", "0,2", "--threads", "1",
               "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    images = results["workload"]["images"]
    assert 0 < images < 6
    off, on = results["configs"]["phase off"], results["configs"]["phase, 2 per step"]
    for row in (off, on):
        assert row["all"]["completed"] == 6 and row["all"]["output_tokens"] == 18
        assert row["images_encoded"] == images
    assert (off["in_phase"], on["in_phase"]) == (0, images)
    assert "| phase, 2 per step | image |" in (out / "summary.md").read_text()
    assert (out / "multimodal.png").is_file()
