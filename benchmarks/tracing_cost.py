"""What request tracing costs: ``python -m benchmarks tracing [--batches 1,16] [--rounds 3]``.

SmolLM2 (bf16) in one in-process engine decodes ``--batches`` requests at once (``--prompt`` tokens,
``--tokens`` out, greedy), alternating untraced runs and runs where every request is traced (the engine
records each step of each request, :func:`xllm.core.request_trace.record_step`; at its end the service
writes its spans, :class:`xllm.engine.tracing.TracedCall`), ``--rounds`` times each. Spans go through the
SDK's batch processor to an exporter that encodes them as OTLP protobuf and drops them (the work of a real
exporter but the network): what the engine's process pays. Reported per batch: step time percentiles off
and on and their ratio; the recording's time per step and the span writing's time per request, timed
directly (they survive a noisy machine better than step-time differences); and the gateway's spans of one
request (root, validate, tokenize, route, one instance call), timed in a loop.

Off, tracing adds one ``if`` per step (an empty weak set) and a dictionary lookup per call: nothing to
measure. Figures: ``docs/performance.md`` ("Request tracing").
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    p.add_argument("--batches", default="1,16", help="requests decoded together (1,16)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (64)")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request (64)")
    p.add_argument("--rounds", type=int, default=3, help="runs each way per batch, alternating (3)")
    p.add_argument("--gateway-requests", type=int, default=2000, help="requests of the gateway span loop (2000)")
    add_output_args(p, "tracing")


def _discarding_exporter():
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Encode(SpanExporter):
        """Encodes each batch as an OTLP export request would be, then drops it."""

        def export(self, spans):
            encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

    return Encode()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def run(args: argparse.Namespace, output: Output) -> dict:
    import torch
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from xllm.core import EngineConfig, LLMEngine
    from xllm.core import engine as engine_module
    from xllm.core.request_trace import RequestTrace
    from xllm.engine.tracing import EngineTracer, TracedCall
    from xllm.engine_api.tracing import Tracing
    from xllm.models import Tokenizer, load_model, resolve_model
    from xllm.proto.engine.v1 import engine_pb2

    output.open()
    model_dir = resolve_model(progress=False)
    tok = Tokenizer(model_dir)
    model = load_model(model_dir, torch.bfloat16, progress=False)
    engine = LLMEngine(model, tok, EngineConfig(dtype=torch.bfloat16, num_threads=args.threads,
                                                kv_cache_memory_gib=0.5, max_model_len=1024))
    queue = {"max_queue_size": 1 << 16}  # (the gateway loop ends thousands of spans at once: none dropped)
    tracing = Tracing(processors=[BatchSpanProcessor(_discarding_exporter(), **queue)], roots=False)
    caller = Tracing(processors=[BatchSpanProcessor(_discarding_exporter(), **queue)])
    tracer = EngineTracer(tracing, engine.instance_id)
    recorded: list[float] = []
    record = engine_module.record_step

    def timed_record(*a):
        t0 = time.perf_counter()
        record(*a)
        recorded.append(time.perf_counter() - t0)

    engine_module.record_step = timed_record
    prompt = (tok.encode("The city library lends books, music and tools to everyone who lives here. ") * 16)
    prompt = prompt[:args.prompt]

    def one_run(batch: int, traced: bool, tag: str) -> tuple[list[float], list[float]]:
        calls = []
        for i in range(batch):
            sp = engine_pb2.SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
            req = engine_pb2.GenerateRequest(request_id=f"{tag}-{i}", prompt_token_ids=prompt, sampling=sp)
            call = None
            if traced:
                parent = caller.start("engine.generate", kind="client")
                call = TracedCall(tracer, tracing.context_of(caller.carrier(parent)), req, RequestTrace())
            engine.add_request(req, call.record if call else None)
            calls.append(call)
        steps, ends = [], []
        while engine.has_work():
            t0 = time.perf_counter()
            for chunk in engine.step():
                call = calls[int(chunk.request_id.rsplit("-", 1)[1])]
                if call is not None:
                    call.observe(chunk)
            steps.append(time.perf_counter() - t0)
        for call in calls:
            if call is not None:
                t0 = time.perf_counter()
                call.end()
                ends.append(time.perf_counter() - t0)
        return steps[2:], ends  # decode steps (the prompt's steps vary with the batch)

    results: dict = {"meta": output.meta(args), "batches": {}, "errors": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        one_run(batch, True, f"warm{batch}")
        off: list[float] = []
        on: list[float] = []
        ends: list[float] = []
        recorded.clear()
        for r in range(args.rounds):
            off += one_run(batch, False, f"off{batch}-{r}")[0]
            steps, e = one_run(batch, True, f"on{batch}-{r}")
            on += steps
            ends += e
        row = {"off_p50_ms": _pct(off, 0.5) * 1e3, "off_p90_ms": _pct(off, 0.9) * 1e3,
               "on_p50_ms": _pct(on, 0.5) * 1e3, "on_p90_ms": _pct(on, 0.9) * 1e3,
               "record_us_per_step": statistics.median(recorded) * 1e6 if recorded else 0.0,
               "spans_us_per_request": statistics.median(ends) * 1e6 if ends else 0.0}
        row["ratio_p50"] = row["on_p50_ms"] / row["off_p50_ms"]
        row["record_share_of_step"] = row["record_us_per_step"] / 1e3 / row["on_p50_ms"]
        results["batches"][str(batch)] = row
        print(f"batch {batch}: step p50 off {row['off_p50_ms']:.2f} ms, on {row['on_p50_ms']:.2f} ms "
              f"(x{row['ratio_p50']:.3f}); recording {row['record_us_per_step']:.1f} us/step, "
              f"spans {row['spans_us_per_request']:.0f} us/request", flush=True)
        output.save(results)
    results["gateway_us_per_request"] = _gateway_loop(caller, args.gateway_requests)
    engine.close()
    tracing.shutdown()
    caller.shutdown()
    return results


def _gateway_loop(tracing, n: int) -> float:
    """Median microseconds of one request's gateway spans (root, three phases, one instance call)."""
    from xllm.gateway.router import Ticket
    from xllm.gateway.tracing import RequestSpans
    from xllm.sched import RouteDecision

    class _State:
        instance_id, role = "engine-0", "mixed"

    ticket = Ticket(_State(), RouteDecision("engine-0", "kv_cache", 0.01, {"engine-0": 1.0, "engine-1": 0.5}),
                    64, 32)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        spans = RequestSpans(tracing, tracing.start("POST /v1/completions", kind="server"))
        with spans.phase("validate"):
            pass
        with spans.phase("tokenize"):
            pass
        with spans.phase("route") as span:
            spans.routed(span, ticket)
        spans.engine_call(ticket, "whole", "r")
        spans.first_token(0.01)
        spans.finished("length", 64, 0.5)
        spans.left(ticket)
        spans.end(200)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def summary(results: dict) -> str:
    cpu = results["meta"].get("machine", {}).get("cpu_model", "?")
    lines = [f"# Request tracing: its cost ({cpu})", "",
             "| batch | step p50 off (ms) | on (ms) | on/off | p90 off | p90 on | recording (µs/step) | "
             "spans (µs/request) |", "|---|---|---|---|---|---|---|---|"]
    for batch, r in results["batches"].items():
        lines.append(f"| {batch} | {r['off_p50_ms']:.2f} | {r['on_p50_ms']:.2f} | {r['ratio_p50']:.3f} | "
                     f"{r['off_p90_ms']:.2f} | {r['on_p90_ms']:.2f} | {r['record_us_per_step']:.1f} | "
                     f"{r['spans_us_per_request']:.0f} |")
    if "gateway_us_per_request" in results:
        lines += ["", f"The gateway's spans of one request: {results['gateway_us_per_request']:.0f} µs."]
    return "\n".join(lines) + "\n"


def plot(results: dict, out_dir) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(results["batches"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k, (mode, colour) in enumerate((("off", "#888888"), ("on", "#d62728"))):
        p50 = [results["batches"][b][f"{mode}_p50_ms"] for b in batches]
        p90 = [results["batches"][b][f"{mode}_p90_ms"] for b in batches]
        xs = [i + (k - 0.5) * 0.35 for i in range(len(batches))]
        ax.bar(xs, p50, 0.35, color=colour, label=f"tracing {mode}")
        ax.errorbar(xs, p50, yerr=[[0] * len(p50), [b - a for a, b in zip(p50, p90, strict=True)]], fmt="none",
                    ecolor="black", capsize=3)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("decode step (ms): p50, whisker p90")
    ax.set_title("Decode step time with every request traced")
    ax.legend()
    fig.tight_layout()
    path = out_dir / "tracing_cost.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]


SCENARIO = Scenario("tracing", "step time with every request traced vs none, in-process", __doc__, add_arguments,
                    run, summary, plot)
