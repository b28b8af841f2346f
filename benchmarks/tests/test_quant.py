"""``python -m benchmarks quant`` / ``benchmarks.quality``: the bytes a decode token streams per format
(against the packed sizes), the agreement and perplexity arithmetic, the summary table, the held-out text,
resident memory, and flag validation. The full run starts servers and takes minutes: not run here."""

from __future__ import annotations

import math
import os

import torch

from benchmarks import quality, quant
from benchmarks.cli import main


def test_held_out_text_is_shipped_and_not_a_benchmark_prompt():
    text = quality.TEXT.read_text()
    assert 4000 < len(text) < 10000 and "MERCUTIO" in text
    from benchmarks.prompts import corpus_text

    assert "Mercutio" not in corpus_text(50_000)


def test_summarize_perplexity_and_agreement():
    raw = {"logprobs": [math.log(0.5), math.log(0.25)], "greedy": [[1, 2, 3, 4], [5, 6, 7, 8]]}
    out = quality.summarize(raw, [[1, 2, 3, 4], [5, 9, 7, 8]])
    assert math.isclose(out["perplexity"], math.sqrt(8))  # exp of the mean NLL (ln 2 + ln 4) / 2
    assert out["greedy_identical"] == 0.5
    assert math.isclose(out["greedy_prefix_agreement"], (1 + 0.25) / 2)


def test_streamed_bytes_counts_packed_weights_and_a_tied_head():
    from xllm.kernels.quant import quantize
    from xllm.models.layers import QuantEmbedding, QuantLinear

    class Inner(torch.nn.Module):
        def __init__(self, embed):
            super().__init__()
            self.embed_tokens = embed
            self.norm = torch.nn.LayerNorm(64)

    class Tiny(torch.nn.Module):
        def __init__(self, embed, lm_head):
            super().__init__()
            self.model = Inner(embed)
            self.proj = QuantLinear(quantize(torch.randn(96, 64), "q4_1"))
            self.lm_head = lm_head

    emb = QuantEmbedding(quantize(torch.randn(100, 64), "q8_0"), torch.bfloat16)
    norm = 2 * 64 * 4  # LayerNorm weight + bias, fp32
    assert quant.streamed_bytes(Tiny(emb, None)) == 96 * 2 * 20 + 100 * 2 * 34 + norm  # tied: the head streams it
    head = torch.nn.Linear(64, 100, bias=False)
    assert quant.streamed_bytes(Tiny(torch.nn.Embedding(100, 64), head)) == 96 * 2 * 20 + 100 * 64 * 4 + norm


def test_markdown_and_rss():
    r = {"threads": 2, "prompt_len": 32, "output_len": 128, "rounds": 4, "concurrency": 16, "bandwidth_gbs": 31.0,
         "bytes_per_token": {"q4_1": 96_500_000}, "errors": {"llamacpp/q8_0": "RuntimeError: boom"},
         "runs": {"xllm/q4_1": {"batch1": {"decode_tok_s_per_request": 160.5, "output_throughput": 150.0},
                                "concurrent": {"output_throughput": 900.0}, "rss_mb": 580.0}}}
    md = quant.markdown(r)
    assert "| xLLM | q4_1 | 96.5 | – | 321 | 160.5 | 50 | 150.0 | 900.0 | 580 |" in md  # one fixed figure
    assert "llamacpp/q8_0 failed: RuntimeError: boom" in md
    # probes around the run: its ceiling is their mean (20 GB/s here, not the run-start 31)
    r["fixed_bandwidth"] = False
    r["runs"]["xllm/q4_1"]["probe_gbs"] = [19.0, 21.0]
    md = quant.markdown(r)
    assert "| xLLM | q4_1 | 96.5 | 19.0 / 21.0 | 207 | 160.5 | 77 | 150.0 | 900.0 | 580 |" in md
    assert "at the start of the run: 31 GB/s" in md
    assert quant.tree_rss_mb(os.getpid()) > 10


def test_unknown_formats_exit_2(capsys):
    assert main(["quant", "--formats", "q3_k"]) == 2
    assert "unknown formats" in capsys.readouterr().err
    assert main(["perplexity", "--variants", "fp8"]) == 2


def test_hugepages_report_and_flags(tmp_path):
    """``python -m benchmarks hugepages``: its summary table and plot from a results dict, and its flag checks
    (the measurement itself loads models and takes minutes: not run here)."""
    from benchmarks import hugepages

    row = {"huge": {"median_ms": 6.75, "best_ms": 6.1}, "4k": {"median_ms": 7.73, "best_ms": 7.2},
           "speedup": 7.73 / 6.75}
    results = {"rounds": 10, "runs": {"q8_0": {"1": row}}, "cpu_busy_before": 0.0, "cpu_busy_after": 0.01}
    text = hugepages.markdown(results)
    assert "| q8_0 | 1 | 6.75 (6.10) | 7.73 (7.20) | 1.15x |" in text
    assert (tmp_path / hugepages.plot(results, tmp_path)).is_file()
    assert main(["hugepages", "--formats", "q9_9", "--out", str(tmp_path)]) == 2
