"""The tracing scenario's report: its table (ratio, percentiles, the recording's and the spans' direct costs)
and its plot, from a canned results file; and its gateway span loop over the real tracer."""

from __future__ import annotations

from benchmarks import tracing_cost


def _row(off: float, on: float) -> dict:
    return {"off_p50_ms": off, "off_p90_ms": off * 1.1, "on_p50_ms": on, "on_p90_ms": on * 1.1,
            "record_us_per_step": 6.0, "spans_us_per_request": 120.0, "ratio_p50": on / off,
            "record_share_of_step": 6e-3 / on}


def test_summary_and_plot(tmp_path):
    results = {"meta": {"machine": {"cpu_model": "AMD EPYC"}}, "batches": {"1": _row(10.0, 10.1),
                                                                           "16": _row(30.0, 30.3)},
               "gateway_us_per_request": 95.0, "errors": {}}
    text = tracing_cost.summary(results)
    assert "AMD EPYC" in text and "| 1 | 10.00 | 10.10 | 1.010 |" in text and "| 16 | 30.00 | 30.30 | 1.010 |" in text
    assert "95 µs" in text
    (png,) = tracing_cost.plot(results, tmp_path)
    assert (tmp_path / "tracing_cost.png").stat().st_size > 1000 and png.endswith("tracing_cost.png")


def test_gateway_loop_writes_real_spans():
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from xllm.engine_api.tracing import Tracing

    memory = InMemorySpanExporter()
    tracing = Tracing(processors=[SimpleSpanProcessor(memory)])
    assert tracing_cost._gateway_loop(tracing, 3) > 0
    names = sorted(s.name for s in memory.get_finished_spans())
    assert names == sorted(["POST /v1/completions", "validate", "tokenize", "route", "engine.generate"] * 3)
    tracing.shutdown()
