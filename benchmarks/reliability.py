"""Reliability benchmark: what clients see when things go wrong, one row per fault.

    python -m benchmarks reliability                           # every scenario on the tiny model (~1-2 min)
    python -m benchmarks reliability --scenarios kill9,sigterm
    python -m benchmarks reliability --model SmolLM2-135M-Instruct --scenarios hostile,kill9
    python -m benchmarks reliability --report benchmarks/results/reliability-20261122-200000

Scenarios (``--scenarios``, in this order; see ``benchmarks/faults.py`` for how each runs):

- ``streams``: 256 concurrent streams on ``xllm serve --instances 2``, all complete;
- ``hostile``: the 78 malformed or abusive requests of ``xllm.testing.hostile``, each a 4xx with an
  OpenAI error body naming the field, ``/health`` 200 after each;
- ``disconnect``: 20 clients that leave mid-stream; the engines' KV back to idle (``/metrics``);
- ``kill9``: ``kill -9`` of the engine running most of 32 streams (half greedy, half seeded
  sampled); every stream's text against an uninterrupted run of the same requests;
- ``flood``: 4x the gateway's ``--max-inflight-requests`` at once, past a small engine queue
  (``--max-waiting``), in waves: every answer a 200 or a 503 with Retry-After, the gateway's RSS;
- ``etcd``: etcd killed and restarted under steady traffic through two gateways;
- ``gateway``: one of two gateways on one etcd killed mid-stream and restarted;
- ``sigterm``: SIGTERM to the engine running most of 32 streams: the gateway moves its running
  requests to the other engine (``--drain-moves auto``: with their KV or by recompute, by predicted
  cost); what is left at the drain timeout is handed back and recomputed. Reported: how many moved
  and how (``xllm:request_moves_total``), KV migrations installed/failed, the pause the client saw;
  same text check.

By default every engine runs a 2-layer random-weight Llama with SmolLM2's tokenizer (built here,
``xllm.testing.models.save_tiny_llama``; the scenarios are about the machinery, not the model) in
float32, so that a stream resumed by recompute is comparable token for token. Columns: cases,
answered (as the scenario requires), 4xx, 5xx, characters lost or duplicated against the
reference run (difflib: missing + extra), KV blocks still in use once the engines report idle,
time to recover. Results: ``results.json``, ``summary.md`` and ``reliability.png`` in ``--out``
(default ``benchmarks/results/reliability-<timestamp>``).
"""

from __future__ import annotations

import argparse
import math
import pathlib
from dataclasses import asdict

from benchmarks.report import add_output_args, pct
from benchmarks.scenario import Output, Scenario
from benchmarks.streamcheck import Row
from xllm.common.argtypes import name_list

SCENARIOS = ("streams", "hostile", "disconnect", "kill9", "flood", "etcd", "gateway", "sigterm")


# ---- report -------------------------------------------------------------------------------------

COLUMNS = ("scenario", "cases", "answered", "4xx", "5xx", "lost or duplicated characters", "KV blocks leaked",
           "time to recover", "result")


def _opt(x: int | None) -> str:
    return "–" if x is None else str(x)


def _seconds(row: dict) -> str:
    s = row.get("recover_s")
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "–"
    return f"{s:.1f} s ({row['recover_what']})" if row.get("recover_what") else f"{s:.1f} s"


def _5xx(row: dict) -> str:
    return f"{row['c5xx']} (all 503 + Retry-After)" if row["c5xx"] and row.get("c5xx_all_503") else str(row["c5xx"])


def table(rows: list[dict]) -> list[str]:
    """The Markdown table of ``rows`` (``Row`` as dicts, as results.json holds them)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        lines.append(f"| {r['title']} | {r['cases']} | {r['answered']} | {r['c4xx']} | {_5xx(r)} | "
                     f"{_opt(r['lost_chars'])} | {_opt(r['leaked_blocks'])} | {_seconds(r)} | "
                     f"{'ok' if not r['problems'] else 'FAIL'} |")
    return lines


def markdown(rows: list[dict], meta: dict, errors: dict[str, str]) -> str:
    m = meta.get("machine", {})
    lines = [
        f"# Reliability ({meta['model']}, {meta['dtype']})",
        "",
        f"Run {meta['timestamp']} at {meta.get('commit') or '?'} on {m.get('cpu_model', '?')} "
        f"({m.get('affinity_cpus', '?')} CPUs); CPU busy before/after: {pct(meta.get('cpu_busy_before'))} / "
        f"{pct(meta.get('cpu_busy_after'))}. Engines: one thread each, KV cache {meta['kv_cache_memory']} GiB each.",
        "",
        *table(rows),
    ]
    for r in rows:
        if r["notes"] or r["problems"]:
            lines += ["", f"**{r['title']}**"]
            lines += [f"- {n}" for n in r["notes"]]
            lines += [f"- **FAILED**: {p}" for p in r["problems"]]
    for name, err in errors.items():
        lines.append(f"\n**{name} did not run to the end**: {err}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Time to recover per scenario; when each stream of the fault scenarios ended after the fault
    (those on the failed instance, moved, apart from the others)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    timed = [r for r in rows if r.get("recover_s") is not None]
    axes[0].barh([r["scenario"] for r in timed], [r["recover_s"] for r in timed], color="tab:orange")
    for i, r in enumerate(timed):
        axes[0].text(r["recover_s"], i, f" {r['recover_s']:.1f} s", va="center", fontsize=8)
    axes[0].set_xlabel("seconds (what each measures: summary.md)")
    axes[0].set_title("time to recover")
    axes[0].invert_yaxis()
    axes[0].grid(True, axis="x", alpha=0.3)
    for r in rows:
        ends, moved = r["details"].get("ends_after_fault_s"), r["details"].get("moved")
        if not ends:
            continue
        for label, keep in (("moved", True), ("not moved", False)):
            xs = sorted(e for e, m in zip(ends, moved) if m == keep)
            if xs:
                axes[1].step([0.0, *xs], [0.0] + [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                             label=f"{r['scenario']}: {label} ({len(xs)})", linestyle="-" if keep else "--")
    axes[1].set_xlabel("seconds after the fault")
    axes[1].set_ylabel("fraction of streams done")
    axes[1].set_title("stream ends after kill -9 / SIGTERM")
    axes[1].grid(True, alpha=0.3)
    if axes[1].lines:
        axes[1].legend(fontsize=8)
    fig.suptitle("xLLM reliability scenarios")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(results: dict) -> str:
    return markdown(results["rows"], results["meta"], results["errors"])


def plot_png(results: dict, out: pathlib.Path) -> None:
    if results["rows"]:
        plot(results["rows"], out / "reliability.png")


def failed(results: dict) -> bool:
    """A scenario did not run to the end or failed one of its requirements."""
    return bool(results["errors"]) or any(r["problems"] for r in results["rows"])


# ---- command line -------------------------------------------------------------------------------

scenario_list = name_list(SCENARIOS, "scenario(s)", in_order=True)  # the table's order (destructive ones last)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenarios", type=scenario_list, default=list(SCENARIOS),
                   help=f"comma-separated subset of {','.join(SCENARIOS)} (default: all)")
    p.add_argument("--model", default=None,
                   help="what every engine serves, as `xllm serve --model` takes it (e.g. SmolLM2-135M-Instruct, the "
                        "bundled model; default: the tiny random Llama with SmolLM2's tokenizer, built in a "
                        "temporary dir)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="engine precision (float32: a resumed stream's recomputed logits match the uninterrupted "
                        "run's; bfloat16 shows more near-ties)")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="KV cache per engine (default: 0.1 for the tiny model, 1.0 for --model)")
    p.add_argument("--streams", type=int, default=256, help="concurrent streams of the streams scenario (256)")
    p.add_argument("--seed", type=int, default=0, help="seeds of the sampled streams start at 1000 + this")
    add_output_args(p, "reliability")


def run(args: argparse.Namespace, output: Output) -> dict:
    import tempfile

    from benchmarks import faults
    from benchmarks.clusters import build_tiny_model
    from benchmarks.machine import cpu_busy_fraction

    out = output.open()
    if args.kv_cache_memory is None:
        args.kv_cache_memory = 1.0 if args.model else 0.1
    with tempfile.TemporaryDirectory(prefix="xllm-reliability-") as tmp:
        model_dir = pathlib.Path(args.model) if args.model else build_tiny_model(pathlib.Path(tmp) / "tiny")
        meta = output.meta(args, model=model_dir.name if args.model else "tiny random Llama (2 layers, SmolLM2 "
                                                                          "tokenizer)")
        print(f"[reliability] scenarios {', '.join(args.scenarios)}; model {meta['model']}; results in {out}",
              flush=True)
        results: dict = {"meta": meta, "rows": [], "errors": {}}

        def record(row: Row) -> None:
            results["rows"].append(asdict(row))
            print(f"[reliability] {row.title}: {'ok' if row.ok else 'FAIL ' + '; '.join(row.problems)}", flush=True)
            output.save(results)

        faults.run(args.scenarios, faults.Settings(model_dir, out, args.dtype, args.kv_cache_memory, args.streams,
                                                   args.seed), record, results["errors"])
    meta["cpu_busy_after"] = cpu_busy_fraction()
    return results


SCENARIO = Scenario("reliability", "faults: kill -9, SIGTERM, etcd, gateway, floods, bad clients", __doc__,
                    add_arguments, run, summary, plot_png, failed=failed)
