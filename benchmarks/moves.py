"""Moves benchmark: what moving a running request off a draining engine costs, KV migration vs
recompute, side by side in one run on the same workload (xLLM §3.5).

    python -m benchmarks moves                                    # SmolLM2 bf16, contexts 128,512,1536
    python -m benchmarks moves --model tiny --contexts 128,512    # the 2-layer tiny model, a quick run
    python -m benchmarks moves --report benchmarks/results/moves-20261123-101500

For each prompt length (``--contexts``) and each way to move (``--modes``) the harness starts a fresh
two-engine cluster, runs ``--streams`` concurrent streams (exact-length prompts of real text as token
ids, half greedy and half seeded sampled, ``--output-len`` tokens each) once uninterrupted (the
reference) and once more with a SIGTERM to the engine running most of them as soon as every stream
has its first chunk. Modes:

- ``migrate``, ``recompute``, ``auto``: ``xllm serve --instances 2 --drain-moves MODE``; the
  draining engine offers each running request to the gateway, which moves it with its KV
  (copied while it keeps decoding, then a short stop) or by recompute on the other engine (prompt +
  output so far prefilled again), or, for ``auto``, whichever it predicts quicker;
- ``off``, the old behaviour as the baseline: no moves; the draining engine lets its requests run
  for ``--off-drain-timeout`` seconds and hands the rest back, which the gateway resumes by
  recompute. ``xllm serve --instances`` has no drain-timeout flag (its engines drain for 30 s), so
  this mode runs etcd + two ``xllm engine --etcd --drain-timeout T`` + one ``xllm serve --etcd``.

Measured, per moved stream (one that started on the drained engine), on the client: the **pause**,
the largest gap between two successive chunks of the stream after the SIGTERM (the move: last chunk
from the source to the first from the destination); the same for the streams that did not move
(what the move cost the destination's own streams); the reference run's median gap between chunks
for scale. From the gateway's ``/metrics`` (deltas over the fault run): ``xllm:request_moves_total``
by ``how``, ``xllm:kv_migrations_total`` by ``outcome``, ``xllm:request_move_pause_seconds`` (the
gateway's own view of the pause); from the logs: the gateway's predicted transfer and recompute
times and choice per move, and the source engine's time stopped per migration. Every stream's text
is compared with the reference run's (characters lost or duplicated; a greedy stream that parts at
a float near-tie is counted apart). Engines run ``--no-prefix-cache`` so that the reference run
leaves nothing cached that would shorten a recompute.

Results: ``results.json``, ``summary.md`` (a row per context and mode; per context the ratio of the
recompute pause to the migration pause, which way ``auto`` chose and whether that was the faster
one measured) and ``moves.png`` in ``--out`` (default ``benchmarks/results/moves-<timestamp>``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import asdict

from benchmarks.movecells import MODES, RunSettings, run_cell, seam_errors
from benchmarks.report import add_output_args, pct
from benchmarks.scenario import Output, Scenario, attempt
from benchmarks.stats import percentile
from xllm.common.argtypes import int_list, name_list

CONTEXTS = (128, 512, 1536)


# ---- figures ------------------------------------------------------------------------------------

def pause_stats(pauses_ms: list[float]) -> dict:
    """p50 / p90 / max / n of the client-visible pauses (ms; NaN-free: None without pauses)."""
    if not pauses_ms:
        return {"n": 0, "p50": None, "p90": None, "max": None}
    return {"n": len(pauses_ms), "p50": percentile(pauses_ms, 50), "p90": percentile(pauses_ms, 90),
            "max": max(pauses_ms)}


def chosen_way(moves: dict[str, float]) -> str:
    """How most requests moved: ``migrate``, ``recompute`` (ties go to migrate) or ``none``."""
    migrated, recomputed = moves.get("migrated", 0), moves.get("recomputed", 0) + moves.get("migration_failed", 0)
    if not migrated and not recomputed:
        return "none"
    return "migrate" if migrated >= recomputed else "recompute"


def comparisons(cells: list[dict]) -> list[dict]:
    """Per context: the migrate and recompute cells' median pauses, their ratio, auto's choice and
    whether auto took the way that was faster as measured (by the median pause)."""
    by = {(c["context"], c["mode"]): c for c in cells}
    out = []
    for ctx in sorted({c["context"] for c in cells}):
        mig = pause_stats(by[(ctx, "migrate")]["pauses_ms"])["p50"] if (ctx, "migrate") in by else None
        rec = pause_stats(by[(ctx, "recompute")]["pauses_ms"])["p50"] if (ctx, "recompute") in by else None
        off = pause_stats(by[(ctx, "off")]["pauses_ms"])["p50"] if (ctx, "off") in by else None
        auto = by.get((ctx, "auto"))
        chose = chosen_way(auto["moves"]) if auto else None
        faster = None if mig is None or rec is None else ("migrate" if mig <= rec else "recompute")
        out.append({"context": ctx, "migrate_p50_ms": mig, "recompute_p50_ms": rec, "off_p50_ms": off,
                    "ratio": rec / mig if mig and rec is not None else None,
                    "auto_chose": chose, "auto_moves": auto["moves"] if auto else None,
                    "auto_p50_ms": pause_stats(auto["pauses_ms"])["p50"] if auto else None,
                    "faster": faster,
                    "auto_right": None if chose in (None, "none") or faster is None else chose == faster})
    return out


# ---- report -------------------------------------------------------------------------------------

def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:.0f}"


def _how(c: dict) -> str:
    parts = [f"{int(n)} {how}" for how, n in sorted(c["moves"].items()) if n]
    if c.get("handed_back"):
        parts.append(f"{c['handed_back']} handed back at the drain timeout")
    return ", ".join(parts) or "none"


CELL_COLUMNS = ("context", "mode", "on the drained engine", "how they moved", "KV migrations installed / failed",
                "pause p50 / p90 / max (ms)", "gateway's pause mean (ms)", "not moved: largest gap p50 (ms)",
                "normal gap p50 (ms)", "texts identical", "tokens lost or repeated", "result")


def cell_table(cells: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(CELL_COLUMNS) + " |", "|" + " --- |" * len(CELL_COLUMNS)]
    for c in cells:
        p = pause_stats(c["pauses_ms"])
        mig = c["migrations"]
        gw = [v["mean_ms"] for v in c["gateway_pause"].values() if v["count"]]
        same = c["streams"] - c["differing"]
        lines.append(
            f"| {c['context']} | {c['mode']} | {c['on_victim']} of {c['streams']} | {_how(c)} | "
            f"{mig.get('installed', 0):.0f} / {mig.get('failed', 0):.0f} | "
            f"{_ms(p['p50'])} / {_ms(p['p90'])} / {_ms(p['max'])} | {' / '.join(_ms(g) for g in gw) or '–'} | "
            f"{_ms(pause_stats(c['bystander_gaps_ms'])['p50'])} | {_ms(c['reference_gap_ms'])} | "
            f"{same} of {c['streams']}" + (f" ({c['near_ties']} near-ties)" if c["near_ties"] else "")
            + f" | {len(seam_errors(c['diverged']))} | {'ok' if not c['problems'] else 'FAIL'} |")
    return lines


def comparison_table(rows: list[dict]) -> list[str]:
    lines = ["| context | migrate pause p50 (ms) | recompute pause p50 (ms) | recompute / migrate | "
             "off (hand-back) pause p50 (ms) | auto chose | auto pause p50 (ms) | faster measured | auto right |",
             "|" + " --- |" * 9]
    for r in rows:
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        moves = ", ".join(f"{int(n)} {h}" for h, n in sorted((r["auto_moves"] or {}).items()) if n)
        right = {None: "–", True: "yes", False: "**no**"}[r["auto_right"]]
        lines.append(f"| {r['context']} | {_ms(r['migrate_p50_ms'])} | {_ms(r['recompute_p50_ms'])} | {ratio} | "
                     f"{_ms(r['off_p50_ms'])} | {r['auto_chose'] or '–'}" + (f" ({moves})" if moves else "")
                     + f" | {_ms(r['auto_p50_ms'])} | {r['faster'] or '–'} | {right} |")
    return lines


def markdown(cells: list[dict], meta: dict, errors: dict[str, str]) -> str:
    m = meta.get("machine", {})
    lines = [
        f"# Moving requests off a draining engine: migrate vs recompute ({meta['model']}, {meta['dtype']})",
        "",
        f"Run {meta['timestamp']} at {meta.get('commit') or '?'} on {m.get('cpu_model', '?')} "
        f"({m.get('affinity_cpus', '?')} CPUs); CPU busy before/after: {pct(meta.get('cpu_busy_before'))} / "
        f"{pct(meta.get('cpu_busy_after'))}. Two engines of one thread each, {meta['streams']} concurrent streams "
        f"(half greedy, half seeded sampled), {meta['output_len']} output tokens each, routing "
        f"{meta['routing']}, no prefix cache; SIGTERM to the engine running most of them once every stream had "
        f"its first chunk. `off`: etcd engines with --drain-timeout {meta['off_drain_timeout']:g} s.",
        "",
        "Pause: per stream that started on the drained engine, the largest gap between two successive chunks "
        "after the SIGTERM, as the client saw it. Not moved: the same for the other streams. Normal gap: the "
        "median gap between chunks in the uninterrupted run. Texts: each stream against the uninterrupted run "
        "(greedy near-ties, top-2 logprobs within 1e-3, apart); tokens lost or repeated: a stream whose whole "
        "rest is the reference's shifted by 1-4 tokens. "
        + ("In float32 every text must be identical." if meta["dtype"] == "float32" else
           "In bfloat16 a stream's logits depend on what else shares its batch (streams that never moved part "
           "too), so only tokens lost or repeated fail a row; run `--dtype float32` for the exact check."),
        "",
        *cell_table(cells),
        "",
        *comparison_table(comparisons(cells)),
    ]
    for c in cells:
        notes = c["notes"] + [f"**FAILED**: {p}" for p in c["problems"]]
        if notes:
            lines += ["", f"**{c['context']} tokens, {c['mode']}**"] + [f"- {n}" for n in notes]
    for name, err in errors.items():
        lines.append(f"\n**{name} did not run to the end**: {err}")
    return "\n".join(lines) + "\n"


def plot(cells: list[dict], path: pathlib.Path) -> None:
    """Pause vs context length per mode: the median, whiskers from the p90 down to the max up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    modes = [m for m in MODES if any(c["mode"] == m for c in cells)]
    for k, mode in enumerate(modes):
        pts = sorted((c["context"], pause_stats(c["pauses_ms"])) for c in cells if c["mode"] == mode
                     and c["pauses_ms"])
        if not pts:
            continue
        xs = [x * (1 + 0.03 * (k - len(modes) / 2)) for x, _ in pts]  # side by side, not on top
        p50 = [p["p50"] for _, p in pts]
        ax.errorbar(xs, p50, yerr=[[0.0] * len(pts), [p["max"] - p["p50"] for _, p in pts]], marker="o",
                    capsize=3, label=f"{mode} (p50, bar to max)")
        ax.scatter(xs, [p["p90"] for _, p in pts], marker="_", s=80, color=ax.lines[-1].get_color())
    ax.set_xscale("log", base=2)
    contexts = sorted({c["context"] for c in cells})
    ax.set_xticks(contexts, [str(x) for x in contexts])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("client-visible pause (ms)")
    ax.set_title("pause of a stream moved off a draining engine")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(results: dict) -> str:
    return markdown(results["cells"], results["meta"], results["errors"])


def plot_png(results: dict, out: pathlib.Path) -> None:
    if any(c["pauses_ms"] for c in results["cells"]):
        plot(results["cells"], out / "moves.png")


def failed(results: dict) -> bool:
    """A cell did not run to the end or failed one of its checks."""
    return bool(results["errors"]) or any(c["problems"] for c in results["cells"])


# ---- command line -------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", type=int_list, default=list(CONTEXTS),
                   help="comma-separated prompt lengths in tokens (default: 128,512,1536)")
    p.add_argument("--modes", type=name_list(MODES, "mode(s)", in_order=True), default=list(MODES),
                   help=f"comma-separated subset of {','.join(MODES)} (default: all)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams per run (8)")
    p.add_argument("--output-len", type=int, default=128,
                   help="output tokens of every stream (128: still decoding well after the SIGTERM)")
    p.add_argument("--model", default=None,
                   help="what the engines serve, as `xllm serve --model` takes it; `tiny` builds the 2-layer "
                        "random Llama with SmolLM2's tokenizer for a quick run (default: the bundled SmolLM2-135M, "
                        "converted from its GGUF)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="engine precision")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="KV cache per engine (default: 1.0, 0.1 for the tiny model)")
    p.add_argument("--routing", default="round_robin", choices=["round_robin", "least_load", "kv_aware"],
                   help="the gateway's routing (round_robin: the streams split evenly, so the destination has "
                        "streams of its own)")
    p.add_argument("--off-drain-timeout", type=float, default=1.0, metavar="SECONDS",
                   help="the off baseline: how long the drained engine keeps its requests before handing them "
                        "back (1.0)")
    p.add_argument("--kv-bandwidth-prior", type=float, default=None, metavar="MB/S",
                   help="passed to xllm serve: the KV bandwidth auto assumes before measuring one (default: "
                        "the gateway's)")
    p.add_argument("--seed", type=int, default=0, help="prompt choice; sampled streams' seeds start at 1000 + this")
    add_output_args(p, "moves")


def run(args: argparse.Namespace, output: Output) -> dict | int:
    import tempfile

    from benchmarks.machine import cpu_busy_fraction
    from benchmarks.prompts import PromptBank

    tiny = args.model == "tiny"
    if args.kv_cache_memory is None:
        args.kv_cache_memory = 0.1 if tiny else 1.0
    out = output.open()
    with tempfile.TemporaryDirectory(prefix="xllm-moves-") as tmp:
        if tiny:
            from benchmarks.clusters import build_tiny_model

            model_dir = build_tiny_model(pathlib.Path(tmp) / "tiny")
        else:
            from benchmarks.peers.xllm import model_dir as xllm_model_dir

            model_dir = xllm_model_dir(args.model)
        max_len = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 0)
        if max(args.contexts) + args.output_len > max_len:
            print(f"python -m benchmarks moves: error: {max(args.contexts)} + {args.output_len} tokens exceed the "
                  f"model's {max_len}", file=sys.stderr)
            return 2
        meta = output.meta(args, model="tiny random Llama (2 layers, SmolLM2 tokenizer)" if tiny else model_dir.name)
        bank = PromptBank(model_dir)
        rs = RunSettings(model_dir, out, args.dtype, args.kv_cache_memory, args.streams, args.output_len,
                         args.routing, args.off_drain_timeout, args.kv_bandwidth_prior, args.seed)
        print(f"[moves] contexts {args.contexts} x modes {args.modes}, {args.streams} streams of {args.output_len} "
              f"tokens; model {meta['model']} {args.dtype}; results in {out}", flush=True)
        results: dict = {"meta": meta, "cells": [], "errors": {}}
        for ctx in args.contexts:
            prompts = [list(p.ids) for p in bank.prompts([ctx] * args.streams, seed=args.seed + ctx)]
            for mode in args.modes:
                name = f"{ctx}/{mode}"
                cell = attempt(results["errors"], name, "moves", run_cell, ctx, mode, prompts, rs, limit=1000)
                if cell is not None:
                    results["cells"].append(asdict(cell))
                    p = pause_stats(cell.pauses_ms)
                    print(f"[moves] {name}: {_how(results['cells'][-1])}; pause p50 {_ms(p['p50'])} max "
                          f"{_ms(p['max'])} ms; {'ok' if not cell.problems else 'FAIL ' + '; '.join(cell.problems)}",
                          flush=True)
                output.save(results)
    meta["cpu_busy_after"] = cpu_busy_fraction()
    return results


SCENARIO = Scenario("moves", "a draining engine's requests: KV migration vs recompute", __doc__, add_arguments, run,
                    summary, plot_png, failed=failed)
