"""The ``kv_tiers`` benchmark's summary table and plot, from its ``results.json`` (pure Python but the plot,
which imports matplotlib with the Agg backend when called)."""

from __future__ import annotations

import pathlib
import statistics

from benchmarks.report import fmt, pct


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def markdown(r: dict) -> str:
    lines = [f"# KV tiers ({r['date']}, {r['model']} {r['dtype']}, commit {r.get('commit') or '?'})", "",
             f"Load average before/after: {_loads(r.get('load_average_before'))} / "
             f"{_loads(r.get('load_average_after'))}; CPU busy before/after: {pct(r.get('cpu_busy_before'))} / "
             f"{pct(r.get('cpu_busy_after'))}.", ""]
    if r.get("sessions"):
        cfg = r.get("sessions_config", {})
        lines += [f"## Sessions ({cfg.get('sessions', '?')} chats x {cfg.get('turns', '?')} turns, one engine, "
                  f"{r['threads']} threads, T0 {r['t0_kv_gib']} GiB; each tier added to the previous ones)", "",
                  "| config | round | requests | working set / T0 | hit rate | TTFT p50 ms | TTFT p99 ms | "
                  "blocks served per tier |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, runs in r["sessions"].items():
            for i, s in enumerate(runs):
                hits = ", ".join(f"{t}: {v['hits']}" for t, v in s["tiers"].items()) or "-"
                lines.append(f"| {name} | {i + 1} | {s['requests']} | "
                             f"{s['working_set_tokens'] / s['t0_capacity_tokens']:.1f}x | {s['hit_rate']:.1%} | "
                             f"{fmt(s['ttft_p50_ms'])} | {fmt(s['ttft_p99_ms'])} | {hits} |")
        lines.append("")
    if r.get("break_even"):
        lines += ["## Break-even: a prefix loaded from one tier against recomputed", "",
                  "| tier | prefix tokens | recompute TTFT ms | load TTFT ms | load / recompute |",
                  "| --- | --- | --- | --- | --- |"]
        for tier, b in r["break_even"].items():
            for row in b["rows"]:
                lines.append(f"| {tier} | {row['prefix_tokens']} | {fmt(row['recompute_ms'])} | "
                             f"{fmt(row['load_ms'])} | {row['load_ms'] / row['recompute_ms']:.2f} |")
        lines += [""] + [f"- {tier}: loading beats recomputing from {b['break_even_tokens']} tokens "
                         f"(reads at {b['read_mb_per_s']} MB/s, checksum included)"
                         for tier, b in r["break_even"].items()] + [""]
    if r.get("cluster"):
        c = r.get("cluster_config", {})
        lines += [f"## Cluster: {c.get('engines', 2)} engines x {c.get('threads_per_engine', 1)} thread, T0 "
                  f"{c.get('kv_gib')} GiB and an own host tier of {c.get('host_gib')} GiB each (host+store: one "
                  "shared Mooncake store too); the same chats, no session ids", "",
                  "| tiers | policy | hit rate | later turns' hit rate | TTFT p50 ms | TTFT p99 ms | later turns' "
                  "TTFT p50 / p99 ms | requests per instance | tier hits (blocks) | failed |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for variant, runs in r["cluster"].items():
            for policy, run in runs.items():
                if "error" in run:
                    lines.append(f"| {variant} | {policy} | failed: {run['error'][:120]} | | | | | | | |")
                    continue
                s = run["summary"]
                spread = ", ".join(f"{k}: {v}" for k, v in s["by_instance"].items())
                hits = "; ".join(f"{i}: " + ", ".join(f"{t} {v:.0f}" for t, v in sorted(ts.items()))
                                 for i, ts in sorted(run["tier_hits"].items())) or "-"
                lines.append(f"| {variant} | {policy} | {s['hit_rate']:.1%} | {s['later_turn_hit_rate']:.1%} | "
                             f"{fmt(s['ttft_p50_ms'])} | {fmt(s['ttft_p99_ms'])} | "
                             f"{fmt(s['later_turn_ttft_p50_ms'])} / {fmt(s['later_turn_ttft_p99_ms'])} | {spread} | "
                             f"{hits} | {s['failed']} |")
        lines.append("")
    return "\n".join(lines)


def _loads(loads) -> str:
    return "?" if not loads else ", ".join(f"{x:.1f}" for x in loads)


def plot(r: dict, path: pathlib.Path) -> str | None:
    """Sessions (TTFT and hit rate per tier configuration), break-even (TTFT against prefix length per tier)
    and the cluster (TTFT and hit rate per policy); returns the file name, or None with nothing to plot."""
    panels = [k for k in ("sessions", "break_even", "cluster") if r.get(k)]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "sessions":
            names = list(r["sessions"])
            _bars(ax, names, [_median(r["sessions"][n], "ttft_p50_ms") for n in names],
                  [_median(r["sessions"][n], "ttft_p99_ms") for n in names],
                  [_median(r["sessions"][n], "hit_rate") for n in names])
            ax.set_title("Chats on one engine: tiers added")
        elif panel == "break_even":
            first = next(iter(r["break_even"].values()))["rows"]
            ax.plot([x["prefix_tokens"] for x in first], [x["recompute_ms"] for x in first], "k--o", label="recompute")
            for tier, b in r["break_even"].items():
                ax.plot([x["prefix_tokens"] for x in b["rows"]], [x["load_ms"] for x in b["rows"]], "o-",
                        label=f"load from {tier}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prefix tokens")
            ax.set_ylabel("TTFT (ms)")
            ax.set_title("Load a prefix or recompute it")
            ax.legend()
        else:
            labels, p50, p99, hit = [], [], [], []
            for variant, runs in r["cluster"].items():
                for policy, run in runs.items():
                    if "summary" in run:
                        labels.append(f"{variant}\n{policy}")
                        p50.append(run["summary"]["ttft_p50_ms"])
                        p99.append(run["summary"]["ttft_p99_ms"])
                        hit.append(run["summary"]["hit_rate"])
            _bars(ax, labels, p50, p99, hit)
            ax.set_title("2 engines: routing policies")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _bars(ax, labels: list[str], p50: list[float], p99: list[float], hit: list[float]) -> None:
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="TTFT p50")
    ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="TTFT p99")
    for x, h, top in zip(xs, hit, p99):
        ax.annotate(f"hit {h:.0%}", (x, top), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("ms")
    ax.legend()
