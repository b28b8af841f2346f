"""The ``kv_tiers`` benchmark's summary table and plot, from its ``results.json`` (pure Python but the plot,
which imports matplotlib with the Agg backend when called)."""

from __future__ import annotations

import pathlib
import statistics

from benchmarks.report import fmt, pct


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``ys`` over ``xs``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def break_even_fit(rows: list[dict]) -> dict:
    """From TTFT rows (prefix tokens, recompute ms, load ms): the shortest measured prefix from which loading
    is faster at every longer length too (``break_even_tokens``, None if never), and straight-line fits of
    both against the prefix length — recompute and load cost per 1k prefix tokens, and the length where the
    lines cross (``crossover_tokens``; at most 0: loading wins from the first block, whatever its size)."""
    xs = [r["prefix_tokens"] for r in rows]
    (a, r_slope), (b, l_slope) = _line(xs, [r["recompute_ms"] for r in rows]), _line(xs, [r["load_ms"] for r in rows])
    faster = [r["load_ms"] < r["recompute_ms"] for r in rows]
    first = next((rows[j]["prefix_tokens"] for j in range(len(rows)) if all(faster[j:])), None)
    crossover = (b - a) / (r_slope - l_slope) if r_slope > l_slope else None
    return {"break_even_tokens": first, "recompute_ms_per_1k_tokens": round(r_slope * 1e3, 1),
            "load_ms_per_1k_tokens": round(l_slope * 1e3, 1),
            "crossover_tokens": None if crossover is None else round(crossover)}


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
        lines.append("")
        for tier, b in r["break_even"].items():
            fit = {**b, **break_even_fit(b["rows"])}
            lines.append(f"- {tier}: loading beats recomputing from {fit['break_even_tokens']} tokens on (the shortest "
                         f"measured); per 1k prefix tokens {fit['load_ms_per_1k_tokens']} ms to load against "
                         f"{fit['recompute_ms_per_1k_tokens']} ms to recompute, the lines crossing at "
                         f"{fit['crossover_tokens']} tokens; reads at {b['read_mb_per_s']} MB/s, checksum included"
                         + (f", {b['load_ms_per_block']} ms per {b.get('block_tokens', '?')}-token block"
                            if b.get("load_ms_per_block") else ""))
        lines.append("")
    if r.get("cluster"):
        c = r.get("cluster_config", {})
        lines += [f"## Cluster: {c.get('engines', 2)} engines x {c.get('threads_per_engine', 1)} thread, T0 "
                  f"{c.get('kv_gib')} GiB and an own host tier of {c.get('host_gib')} GiB each (host+store: one "
                  "shared Mooncake store too); the same chats, no session ids", "",
                  "| tiers | policy | hit rate | later turns' hit rate | TTFT p50 ms | TTFT p99 ms | later turns' "
                  "TTFT p50 / p99 ms | requests per instance | tier hits (blocks) | failed |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for variant, policy, run in _cluster_runs(r["cluster"]):
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


def _as_list(runs) -> list[dict]:
    return runs if isinstance(runs, list) else [runs]  # (results of one round per policy: a dict)


def _cluster_runs(cluster: dict):
    """(variant, policy, run) in round order within each variant."""
    for variant, runs in cluster.items():
        per_policy = {policy: _as_list(x) for policy, x in runs.items()}
        for rnd in range(max(map(len, per_policy.values()), default=0)):
            for policy, policy_runs in per_policy.items():
                if rnd < len(policy_runs):
                    yield variant, policy if rnd == 0 else f"{policy} (round {rnd + 1})", policy_runs[rnd]


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
                for policy, policy_runs in runs.items():
                    done = [x["summary"] for x in _as_list(policy_runs) if "summary" in x]
                    if done:
                        labels.append(f"{variant}\n{policy}")
                        p50.append(statistics.median(x["ttft_p50_ms"] for x in done))
                        p99.append(statistics.median(x["ttft_p99_ms"] for x in done))
                        hit.append(statistics.median(x["hit_rate"] for x in done))
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
