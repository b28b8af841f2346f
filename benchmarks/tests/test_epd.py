"""``python -m benchmarks epd`` end to end on the tiny random Qwen2-VL (made in a temporary cache), one
configuration (``e+p+d``: three engine processes behind ``xllm serve``): every request is served, every image was
encoded by the encode instance with no fallback, the phases were measured and the profiler ranked the layouts,
and the report has its table and plot. Figures are not checked (timings)."""

from __future__ import annotations

import json

from benchmarks.cli import main


def test_a_tiny_e_p_d_run_serves_every_request_and_encodes_on_the_encode_instance(tmp_path, monkeypatch):
    monkeypatch.setenv("XLLM_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    rc = main(["epd", "--model-size", "tiny", "--configs", "e+p+d", "--requests", "4", "--rate", "20",
               "--image-size", "56", "--tokens", "3", "--image-fraction", "0.5", "--seed", "3", "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    images = results["workload"]["images"]
    assert 0 < images < 4
    row = results["configs"]["e+p+d"]
    assert row["all"]["completed"] == 4 and row["all"]["output_tokens"] == 12
    # the warm-up's image request and the run's, each encoded on the encode instance, none left to the prefill one
    assert row["epd"] == {"epd_encodes": images + 1, "epd_encode_fallbacks": 0}
    assert {p["strategy"] for p in results["predicted"]} == {"ep+d", "ed+p", "e+p+d"}
    assert results["phases"]["encode_s"] > 0 and results["pick"] in ("ep+d", "ed+p", "e+p+d")
    assert "| e+p+d | image |" in (out / "summary.md").read_text()
    assert (out / "epd.png").is_file()
