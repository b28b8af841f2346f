"""Turn ``results.json`` into a Markdown summary (ratios ours/peer, roofline fractions) and PNG plots.

The table logic is pure Python (unit-tested); plotting imports matplotlib (Agg backend) only when called.
``python -m benchmarks report DIR`` rebuilds both from a saved ``DIR/results.json``. :func:`write_outputs`
is the one report shape of every scenario (results file, Markdown summary, plot), :func:`add_output_args`
their shared output flags.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass, field

DISPLAY = {"xllm": "xLLM", "xllm-offline": "xLLM offline", "vllm": "vLLM", "llamacpp": "llama.cpp", "hf": "HF"}
SYSTEM_ORDER = ("xllm", "xllm-offline", "vllm", "llamacpp", "hf")
# (ours, peer): the ratio columns; xLLM offline vs HF generate is the offline apples-to-apples pair
RATIO_PAIRS = (("xllm", "vllm"), ("xllm", "llamacpp"), ("xllm", "hf"), ("xllm-offline", "hf"))



def add_output_args(p, name: str, report: bool = True) -> None:
    """The output flags every standalone scenario shares: ``--out``, ``--no-plots`` and (``report``)
    ``--report DIR`` to rebuild the summary and plots from a finished run's ``results.json``."""
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help=f"results dir (default: benchmarks/results/{name}-<timestamp>)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    if report:
        p.add_argument("--report", type=pathlib.Path, default=None, metavar="DIR",
                       help="only rebuild summary.md and the plots from DIR/results.json")

@dataclass
class Row:
    label: str
    values: dict[str, float] = field(default_factory=dict)
    higher_better: bool = True


def fmt(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    ax = abs(x)
    if ax >= 100:
        return f"{x:,.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def pct(x: float | None) -> str:
    """A fraction as a percentage ("?" when unknown)."""
    return "?" if x is None else f"{x:.0%}"


def ratio(ours: float | None, peer: float | None) -> float | None:
    """ours / peer, or None when either is missing, NaN or the peer's is 0."""
    if ours is None or peer is None or math.isnan(ours) or math.isnan(peer) or peer == 0:
        return None
    return ours / peer


def _tpot_p50(run: dict) -> float | None:
    s = run["summary"]
    if run["kind"] == "offline":
        return s.get("step_ms", {}).get("p50")
    return s.get("tpot_ms", {}).get("p50")


def _tpot_p99(run: dict) -> float | None:
    s = run["summary"]
    return (s.get("step_ms", {}) if run["kind"] == "offline" else s.get("tpot_ms", {})).get("p99")


def _labels(results: dict) -> list[tuple[str, str]]:
    """(label, dtype) of the runs in first-seen order, batch-1 first, then concurrency by level."""
    seen: list[tuple[str, str]] = []
    for r in results.get("runs", []):
        key = (r["label"], r["dtype"])
        if key not in seen:
            seen.append(key)

    def order(key):
        label, dtype = key
        if label == "batch1":
            rank = (0, 0)
        elif label.startswith("concurrency-"):
            rank = (1, int(label.split("-")[1]))
        else:
            rank = (2, 0)
        return (rank, dtype != "bfloat16", dtype)
    return sorted(seen, key=order)


def _pretty(label: str, dtype: str) -> str:
    short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)
    if label == "batch1":
        return f"batch 1, {short}"
    if label.startswith("concurrency-"):
        return f"{label.split('-')[1]} concurrent, {short}"
    return f"{label}, {short}"


def headline_rows(results: dict) -> list[Row]:
    """The rows of the main table: per scenario and dtype, the headline figures of every system."""
    rows: list[Row] = []
    for label, dtype in _labels(results):
        runs = {r["system"]: r for r in results["runs"] if r["label"] == label and r["dtype"] == dtype}
        name = _pretty(label, dtype)

        def row(metric: str, get, higher_better: bool = True, name=name, runs=runs) -> None:
            vals = {}
            for sys_, run in runs.items():
                try:
                    v = get(run)
                except (KeyError, TypeError):
                    v = None
                if v is not None and not (isinstance(v, float) and math.isnan(v)):
                    vals[sys_] = float(v)
            if vals:
                rows.append(Row(f"{name}: {metric}", vals, higher_better))

        row("output tok/s", lambda r: r["summary"]["output_throughput"])
        if label == "batch1":
            row("decode tok/s (1/TPOT p50)", lambda r: r["summary"]["decode_tok_s_per_request"])
        else:
            row("total tok/s", lambda r: r["summary"]["total_throughput"])
        row("TTFT p50 ms (lower better)", lambda r: r["summary"]["ttft_ms"]["p50"], False)
        row("TPOT p50 ms (lower better)", _tpot_p50, False)
        if label != "batch1":
            row("TPOT p99 ms (lower better)", _tpot_p99, False)
        if label.startswith("online"):
            row("goodput req/s", lambda r: r["summary"].get("goodput"))
    for dtype in sorted({s["dtype"] for s in results.get("sweeps", [])}):
        sweeps = {s["system"]: s for s in results["sweeps"] if s["dtype"] == dtype}
        any_s = next(iter(sweeps.values()))
        what = (f"{any_s['arrival']} rate sweep, {dtype}: max req/s with >= {any_s['target']:.0%} "
                f"meeting {any_s['slo_text']}")
        rows.append(Row(what, {k: float(s["best_rate"]) for k, s in sweeps.items() if s["best_rate"] is not None}))
        rows.append(Row(f"{any_s['arrival']} rate sweep, {dtype}: goodput at that rate (req/s)",
                        {k: float(s["goodput_at_best"]) for k, s in sweeps.items()
                         if s.get("goodput_at_best") is not None}))
    return rows


def present_systems(results: dict) -> list[str]:
    found = {r["system"] for r in results.get("runs", [])} | {s["system"] for s in results.get("sweeps", [])}
    return [s for s in SYSTEM_ORDER if s in found]


def markdown_table(rows: list[Row], systems: list[str]) -> str:
    pairs = [(a, b) for a, b in RATIO_PAIRS if a in systems and b in systems]
    head = ["scenario: metric", *(DISPLAY[s] for s in systems), *(f"{DISPLAY[a]} / {DISPLAY[b]}" for a, b in pairs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([" --- "] + [" ---: "] * (len(head) - 1)) + "|"]
    for row in rows:
        cells = [row.label, *(fmt(row.values.get(s)) for s in systems)]
        for a, b in pairs:
            r = ratio(row.values.get(a), row.values.get(b))
            cells.append("–" if r is None else f"{r:.2f}×")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def roofline_rows(results: dict) -> list[tuple[str, float | None, dict[str, float]]]:
    """(scenario, ceiling output tok/s, {system: fraction of it}), plus batch-1 decode rows."""
    out = []
    for label, dtype in _labels(results):
        runs = [r for r in results["runs"] if r["label"] == label and r["dtype"] == dtype and r.get("roofline")]
        if not runs:
            continue
        name = _pretty(label, dtype)
        ceiling = runs[0]["roofline"].get("ceiling_output_tok_s")
        out.append((f"{name}: output tok/s", ceiling,
                    {r["system"]: r["roofline"]["output_fraction"] for r in runs}))
        if label == "batch1":
            dec = runs[0]["roofline"].get("ceiling_decode_tok_s")
            out.append((f"{name}: decode tok/s (bandwidth-bound)", dec,
                        {r["system"]: r["roofline"]["decode_fraction"] for r in runs
                         if "decode_fraction" in r["roofline"]}))
    return out


def roofline_table(results: dict, systems: list[str]) -> str:
    head = ["scenario: figure", "ceiling", *(f"{DISPLAY[s]} % of ceiling" for s in systems)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([" --- "] + [" ---: "] * (len(head) - 1)) + "|"]
    for name, ceiling, fr in roofline_rows(results):
        cells = [name, fmt(ceiling)]
        for s in systems:
            v = fr.get(s)
            cells.append("–" if v is None or math.isnan(v) else f"{100 * v:.0f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_markdown(results: dict) -> str:
    meta = results.get("meta", {})
    systems = present_systems(results)
    machine = meta.get("machine", {})
    parts = ["# xLLM-py benchmark", ""]
    parts.append(f"- Run {meta.get('timestamp', '?')} · model `{meta.get('model', '?')}` · "
                 f"threads per system: {meta.get('threads', '?')} · commit `{meta.get('commit', '?')}`")
    parts.append(f"- Machine: {machine.get('cpu_model', '?')}, {machine.get('logical_cpus', '?')} logical CPUs, "
                 f"{machine.get('ram_gib', '?')} GiB RAM")
    busy = [meta.get(k) for k in ("cpu_busy_before", "cpu_busy_after")]
    if any(b is not None for b in busy):
        parts.append("- Other load on the CPUs (idle harness) before / after the run: " +
                     " / ".join("?" if b is None else f"{b:.0%}" for b in busy) +
                     (" — **busy machine: figures are not comparable**" if any(b and b > 0.1 for b in busy) else ""))
    versions = meta.get("versions", {})
    if versions:
        parts.append("- Versions: " + "; ".join(
            f"{DISPLAY.get(k, k)} " + ", ".join(f"{d} {v}" for d, v in sorted(vs.items()))
            for k, vs in versions.items()))
    parts += ["", "## Side by side", "",
              "Ratios are ours / peer of the figure in that row (> 1 is better for throughput rows, "
              "< 1 is better for latency rows). xLLM is the server (`xllm serve`) measured by the streaming "
              "client; xLLM offline is `LLMEngine` in-process; HF is `generate` offline, statically batched.", ""]
    rows = headline_rows(results)
    parts.append(markdown_table(rows, systems) if rows else "(no runs)")
    roof = results.get("roofline")
    if roof:
        lim = roof["limits"]
        parts += ["", "## Roofline", "",
                  f"Measured on {lim['threads']} threads: memory read bandwidth {lim['bandwidth_gbs']:.1f} GB/s; "
                  f"matmul {lim['matmul_size']}² fp32 {lim['matmul_gflops']['float32']:.0f} GFLOP/s, "
                  f"bf16 {lim['matmul_gflops']['bfloat16']:.0f} GFLOP/s; torch GEMV (M=1) effective "
                  f"fp32 {lim['gemv_gbs']['float32']:.1f} GB/s, bf16 {lim['gemv_gbs']['bfloat16']:.1f} GB/s.", ""]
        for dt, c in roof.get("ceilings", {}).items():
            parts.append(f"- {dt}: {c['weight_bytes_per_step'] / 1e6:.0f} MB of weights per step, "
                         f"{c['gflop_per_token']:.3f} GFLOP/token; batch-1 decode ceiling "
                         f"{c['decode_batch1_tok_s']:.0f} tok/s (bandwidth), prefill ceiling "
                         f"{c['prefill_tok_s']:.0f} tok/s (compute)")
        rr = roofline_table(results, systems)
        if roofline_rows(results):
            parts += ["", "Fraction of the physical limit reached (ceiling = lower bound on time from bandwidth and "
                      "FLOP/s for that scenario's batch, prompt and output lengths):", "", rr]
    errors = results.get("errors", [])
    if errors:
        parts += ["", "## Errors", ""]
        parts += [f"- {DISPLAY.get(e['system'], e['system'])}: {e['what']}: {e['error'].splitlines()[0][:300]}"
                  for e in errors]
    plots = meta.get("plots", [])
    if plots:
        parts += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(parts) + "\n"


# ---- plots -------------------------------------------------------------------------------------------

_COLORS = {"xllm": "tab:blue", "xllm-offline": "tab:cyan", "vllm": "tab:orange", "llamacpp": "tab:green",
           "hf": "tab:red"}


def make_plots(results: dict, out_dir: pathlib.Path) -> list[str]:
    """Write the PNGs; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: list[str] = []
    runs = results.get("runs", [])
    for dtype in sorted({r["dtype"] for r in runs}):
        # throughput vs concurrency
        pts: dict[str, list[tuple[int, float]]] = {}
        ceil: dict[int, float] = {}
        for r in runs:
            if r["dtype"] != dtype or (r["label"] != "batch1" and not r["label"].startswith("concurrency-")):
                continue
            level = 1 if r["label"] == "batch1" else int(r["label"].split("-")[1])
            pts.setdefault(r["system"], []).append((level, r["summary"]["output_throughput"]))
            if r.get("roofline", {}).get("ceiling_output_tok_s"):
                ceil[level] = r["roofline"]["ceiling_output_tok_s"]
        if pts:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for sys_, xy in sorted(pts.items(), key=lambda kv: SYSTEM_ORDER.index(kv[0])):
                xy.sort()
                ax.plot([x for x, _ in xy], [y for _, y in xy], "o-", color=_COLORS[sys_], label=DISPLAY[sys_])
            if ceil:
                xs = sorted(ceil)
                ax.plot(xs, [ceil[x] for x in xs], "k--", label="roofline ceiling")
            ax.set_xscale("log", base=2)
            levels = sorted({x for xy in pts.values() for x, _ in xy})
            ax.set_xticks(levels, [str(x) for x in levels])
            ax.minorticks_off()
            ax.set_xlabel("concurrent requests (batch size)")
            ax.set_ylabel("output tokens/s")
            ax.set_title(f"Throughput vs concurrency ({dtype})")
            ax.grid(True, alpha=0.3)
            ax.legend()
            name = f"throughput_vs_concurrency_{dtype}.png"
            fig.tight_layout()
            fig.savefig(out_dir / name, dpi=110)
            plt.close(fig)
            files.append(name)
        # TTFT CDFs
        panels = [(r["label"], r) for r in runs if r["dtype"] == dtype]
        labels = sorted({lb for lb, _ in panels}, key=lambda lb: (lb != "batch1", len(lb), lb))
        if labels:
            fig, axes = plt.subplots(1, len(labels), figsize=(4.2 * len(labels), 4), squeeze=False)
            for ax, lb in zip(axes[0], labels):
                for lb2, r in panels:
                    ttfts = sorted(x["ttft"] * 1e3 for x in r["records"] if x.get("ttft") is not None)
                    if lb2 != lb or not ttfts:
                        continue
                    ys = [0.0] + [(i + 1) / len(ttfts) for i in range(len(ttfts))]
                    ax.step([ttfts[0], *ttfts], ys, where="post", color=_COLORS[r["system"]],
                            label=DISPLAY[r["system"]])
                ax.set_title(_pretty(lb, dtype))
                ax.set_xlabel("TTFT (ms)")
                ax.set_ylabel("fraction of requests")
                ax.grid(True, alpha=0.3)
                ax.legend(fontsize=8)
            fig.suptitle(f"TTFT CDF ({dtype})")
            fig.tight_layout()
            name = f"ttft_cdf_{dtype}.png"
            fig.savefig(out_dir / name, dpi=110)
            plt.close(fig)
            files.append(name)
    for dtype in sorted({s["dtype"] for s in results.get("sweeps", [])}):
        sweeps = [s for s in results["sweeps"] if s["dtype"] == dtype]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
        styles = {"p50": "-", "p90": "--", "p99": ":"}
        for s in sweeps:
            c = _COLORS[s["system"]]
            rates = [p["rate"] for p in s["points"]]
            for q, ls in styles.items():
                axes[0].plot(rates, [p["summary"]["ttft_ms"][q] for p in s["points"]], ls, marker="o", color=c,
                             label=f"{DISPLAY[s['system']]} {q}")
                axes[1].plot(rates, [p["summary"]["tpot_ms"][q] for p in s["points"]], ls, marker="o", color=c,
                             label=f"{DISPLAY[s['system']]} {q}")
            axes[2].plot(rates, [p["attainment"] for p in s["points"]], "o-", color=c, label=DISPLAY[s["system"]])
        s0 = sweeps[0]
        if s0["slo"].get("ttft_ms"):
            axes[0].axhline(s0["slo"]["ttft_ms"], color="k", lw=1, ls="-.", label="SLO")
        if s0["slo"].get("tpot_ms"):
            axes[1].axhline(s0["slo"]["tpot_ms"], color="k", lw=1, ls="-.", label="SLO")
        axes[2].axhline(s0["target"], color="k", lw=1, ls="-.", label="target")
        ylabels = ("ms", "ms", f"fraction meeting {s0['slo_text']}")
        for ax, t, yl in zip(axes, ("TTFT", "TPOT", "SLO attainment"), ylabels):
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(yl)
            ax.set_title(f"{t} vs request rate")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        axes[0].set_yscale("log")
        fig.suptitle(f"{s0['arrival']} arrivals, {dtype}")
        fig.tight_layout()
        name = f"latency_vs_rate_{dtype}.png"
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        files.append(name)
    return files


def save_json(path: pathlib.Path, results: dict) -> None:
    """A results file (numbers that JSON lacks, e.g. numpy scalars, as floats)."""
    import json

    path.write_text(json.dumps(results, indent=1, default=float))


def write_outputs(results: dict, out_dir: pathlib.Path, summary, plot=None,
                  files: tuple[str, str] = ("results.json", "summary.md")) -> str:
    """The report shape every scenario shares: ``plot(results, out_dir)`` (when given; skipped with a
    note when matplotlib is missing), then the results file and the Markdown ``summary(results)`` into
    ``out_dir`` (``files``: their names); returns the summary. A plot may record its files in
    ``results`` before they are written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if plot is not None:
        try:
            plot(results, out_dir)
        except ImportError as exc:
            print(f"[bench] no plots: {exc} (pip install matplotlib)")
    save_json(out_dir / files[0], results)
    text = summary(results)
    (out_dir / files[1]).write_text(text)
    return text


def record_plots(results: dict, out_dir: pathlib.Path) -> None:
    """The peer suite's plots, their file names kept in ``results["meta"]["plots"]``."""
    results.setdefault("meta", {})["plots"] = make_plots(results, out_dir)


def write_report(results: dict, out_dir: pathlib.Path, plots: bool = True) -> str:
    """The peer suite's plots (if matplotlib is there), ``results.json`` and ``summary.md`` into
    ``out_dir``; returns the summary."""
    return write_outputs(results, out_dir, summary_markdown, record_plots if plots else None)
