import math

import pytest

from benchmarks.report import Row, fmt, headline_rows, markdown_table, ratio, roofline_table, summary_markdown


def run(system, label, dtype, out_tps, ttft_ms, tpot_ms, kind="server", fraction=None):
    summary = {"output_throughput": out_tps, "total_throughput": out_tps * 1.25, "decode_tok_s_per_request":
               1000 / tpot_ms, "ttft_ms": {"p50": ttft_ms}, "tpot_ms": {"p50": tpot_ms, "p99": 2 * tpot_ms}}
    if kind == "offline":
        summary["step_ms"] = summary.pop("tpot_ms")
    roof = {} if fraction is None else {"ceiling_output_tok_s": out_tps / fraction, "output_fraction": fraction,
                                        "ceiling_decode_tok_s": 100.0, "decode_fraction": (1000 / tpot_ms) / 100}
    return {"system": system, "label": label, "dtype": dtype, "kind": kind, "summary": summary, "roofline": roof,
            "records": []}


@pytest.fixture
def results():
    return {"meta": {"timestamp": "t", "model": "m", "threads": 2, "machine": {"cpu_model": "cpu"}},
            "runs": [run("xllm", "batch1", "bfloat16", 30.0, 50.0, 25.0, fraction=0.5),
                     run("vllm", "batch1", "bfloat16", 20.0, 40.0, 40.0, fraction=1 / 3),
                     run("hf", "batch1", "bfloat16", 15.0, 60.0, 50.0, kind="offline", fraction=0.25),
                     run("xllm-offline", "batch1", "bfloat16", 45.0, 30.0, 20.0, kind="offline"),
                     run("xllm", "concurrency-16", "bfloat16", 300.0, 200.0, 50.0),
                     run("vllm", "concurrency-16", "bfloat16", 200.0, 100.0, 60.0)],
            "sweeps": [{"system": "xllm", "dtype": "bfloat16", "arrival": "poisson", "target": 0.9,
                        "slo_text": "TPOT <= 100 ms", "best_rate": 3.0, "goodput_at_best": 2.8},
                       {"system": "vllm", "dtype": "bfloat16", "arrival": "poisson", "target": 0.9,
                        "slo_text": "TPOT <= 100 ms", "best_rate": 2.0, "goodput_at_best": 1.9}],
            "errors": [{"system": "llamacpp", "what": "install/start (bfloat16)", "error": "boom"}]}


def test_ratio_and_fmt():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None and ratio(math.nan, 1.0) is None
    assert fmt(1234.4) == "1,234" and fmt(12.345) == "12.3" and fmt(1.2345) == "1.23" and fmt(None) == "–"


def test_headline_rows(results):
    rows = {r.label: r for r in headline_rows(results)}
    b1 = rows["batch 1, bf16: output tok/s"]
    assert b1.values == {"xllm": 30.0, "vllm": 20.0, "hf": 15.0, "xllm-offline": 45.0}
    assert rows["batch 1, bf16: decode tok/s (1/TPOT p50)"].values["xllm"] == pytest.approx(40.0)
    # offline runs report their decode-step latency as TPOT
    assert rows["batch 1, bf16: TPOT p50 ms (lower better)"].values["hf"] == 50.0
    assert not rows["batch 1, bf16: TTFT p50 ms (lower better)"].higher_better
    assert rows["16 concurrent, bf16: TPOT p99 ms (lower better)"].values == {"xllm": 100.0, "vllm": 120.0}
    sweep = next(r for label, r in rows.items() if "max req/s" in label)
    assert sweep.values == {"xllm": 3.0, "vllm": 2.0}
    order = list(rows)
    assert order.index("batch 1, bf16: output tok/s") < order.index("16 concurrent, bf16: output tok/s")


def test_markdown_table_ratios():
    rows = [Row("x: output tok/s", {"xllm": 30.0, "vllm": 20.0, "hf": 15.0, "xllm-offline": 45.0}),
            Row("y: output tok/s", {"xllm": 10.0})]
    table = markdown_table(rows, ["xllm", "xllm-offline", "vllm", "hf"])
    lines = table.splitlines()
    assert lines[0] == ("| scenario: metric | xLLM | xLLM offline | vLLM | HF | xLLM / vLLM | xLLM / HF "
                        "| xLLM offline / HF |")
    assert lines[2] == "| x: output tok/s | 30.0 | 45.0 | 20.0 | 15.0 | 1.50× | 2.00× | 3.00× |"
    assert lines[3] == "| y: output tok/s | 10.0 | – | – | – | – | – | – |"


def test_roofline_table_fractions(results):
    table = roofline_table(results, ["xllm", "vllm", "hf"])
    assert "| batch 1, bf16: output tok/s | 60.0 | 50% | 33% | 25% |" in table
    assert "| batch 1, bf16: decode tok/s (bandwidth-bound) | 100 | 40% | 25% | 20% |" in table


def test_summary_markdown_mentions_everything(results):
    text = summary_markdown(results)
    assert "## Side by side" in text and "xLLM / vLLM" in text
    assert "llama.cpp: install/start (bfloat16): boom" in text
