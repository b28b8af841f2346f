"""The recsys scenario's workload and report (the systems' runs need the models: `python -m benchmarks recsys`)."""

from __future__ import annotations

import numpy as np

from benchmarks import recsys
from xllm.recsys.catalog import ItemCatalog


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 50 for c in text[:5]]


def test_catalogue_and_prompts(tmp_path):
    items = recsys.make_catalogue(tmp_path / "items.npy", 5000)
    assert items.shape == (5000, 3) and items.dtype == np.int32
    for d in range(3):  # one 256-id codebook per position, disjoint
        lo = recsys.TOKEN_BASE + d * recsys.CODEBOOK
        assert items[:, d].min() >= lo and items[:, d].max() < lo + recsys.CODEBOOK
    assert ItemCatalog.load(tmp_path / "items.npy").item_len == 3
    prompts = recsys.make_prompts(_Tok(), items, 3)
    assert len(prompts) == 3 and all(len(p) == 5 + 3 * recsys.HISTORY for p in prompts)


def test_report_ratios_against_vllm(tmp_path):
    row = {"requests": 3, "p50_s": 0.1, "p99_s": 0.2, "req_per_s": 10.0}
    results = {"load": [0.1, 0.2], "runs": {"smollm2": {
        "xllm": {"16": row}, "vllm": {"16": {**row, "req_per_s": 0.5}}, "hf": {"error": "boom"}}}}
    recsys.SCENARIO.report(results, tmp_path, plots=False)
    text = (tmp_path / "summary.md").read_text()
    assert "| smollm2 | 16 | xllm | 0.100 | 0.200 | 10.00 | 20.0x |" in text
    assert "hf failed" in text
