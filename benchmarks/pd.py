"""PD benchmark: one prefill + one decode instance against two mixed instances, on the same cores.

    python -m benchmarks pd                              # mixed, mixed-chunked, pd-fd, pd-grpc, pd-mooncake
    python -m benchmarks pd --configs mixed,pd-fd --requests 24 --rate 0.15
    python -m benchmarks pd --report benchmarks/results/pd-20261122-160000   # rebuild summary.md + pd.png

Every configuration is ``xllm serve`` on the same model with two engine processes of one thread
each: ``mixed`` = ``--instances 2`` (each instance prefills and decodes: a prompt chunk of up to
2048 tokens, the default step budget, joins the decode steps); ``mixed-chunked`` = the same with
256-token chunks (``--max-num-batched-tokens 256``: mixed mode's own answer to prefill stalls);
``pd-<transport>`` = ``--prefill-instances 1
--decode-instances 1 --kv-transfer <transport>`` (``mooncake`` hands off through the engines' T3
tier: ``--kv-store local-mooncake``, a store ``xllm serve`` starts and stops). The workload is the
one PD exists for: long prompts (``--long-prompt-len``, 2048 tokens, a ``--long-fraction`` of the
requests) among short ones, every request with a long output (``--output-len``), arriving as a
Poisson stream (``--rate``). Each configuration starts fresh, is warmed up, replays the same
requests and is stopped.

Reported per configuration: TTFT and TPOT p50/p99 (all requests and per class), goodput and SLO
attainment under ``--slo-tpot-ms``; for PD also the KV moved per request (bytes, and the decode
side's transfer time: mean and histogram p50/p99), transfer failures, and the mean TTFT breakdown
(queue, prefill, transfer, first decode) from the gateway's ``/metrics``. Ratios are PD over
mixed. Results: ``results.json``, ``summary.md`` and ``pd.png`` in ``--out`` (default
``benchmarks/results/pd-<timestamp>``).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import random
import sys
from dataclasses import dataclass, fields

from benchmarks.client import EndpointProfile, RequestSpec, run_requests
from benchmarks.metrics import histogram_quantile, scrape, total
from benchmarks.peers.xllm import model_dir as xllm_model_dir
from benchmarks.peers.xllm import wait_instances
from benchmarks.report import add_output_args, pct, ratio
from benchmarks.scenario import Output, Scenario, attempt
from benchmarks.stats import SLO, RequestRecord, goodput, serving_summary, slo_attainment

TRANSPORTS = ("fd", "grpc", "mooncake")
CHUNKED = 256  # the prefill chunk of the "mixed-chunked" configuration
CONFIGS = ("mixed", "mixed-chunked", *(f"pd-{t}" for t in TRANSPORTS))
PHASES = ("queue", "prefill", "transfer", "first_decode")
GOODPUT_TPOT_MS = (25, 35, 50, 100)  # the goodput table's objectives


@dataclass(frozen=True)
class Workload:
    specs: list[RequestSpec]
    long: list[bool]  # which requests have the long prompt


def build_workload(bank, args: argparse.Namespace) -> Workload:
    """``args.requests`` requests, a ``long_fraction`` of them with long prompts (shuffled), all
    with ``output_len`` output tokens, at Poisson arrivals of ``args.rate`` req/s."""
    from benchmarks.workload import poisson_arrivals

    rng = random.Random(args.seed)
    n_long = round(args.requests * args.long_fraction)
    kinds = [True] * n_long + [False] * (args.requests - n_long)
    rng.shuffle(kinds)
    arrivals = poisson_arrivals(args.rate, args.requests, args.seed)
    specs = []
    for is_long, t in zip(kinds, arrivals):
        p = bank.prompt(args.long_prompt_len if is_long else args.short_prompt_len, rng)
        specs.append(RequestSpec(p.ids, p.text, args.output_len, t))
    return Workload(specs, kinds)


# ---- /metrics -------------------------------------------------------------------------------------

def pd_figures(before: dict, after: dict, transport: str, requests: int) -> dict:
    """What moved between the two scrapes: KV bytes and transfer time per request, failures, and
    the mean TTFT breakdown."""
    def diff(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    les = sorted({float(lb["le"]) for lb, _ in after.get("xllm:kv_transfer_seconds_bucket", [])
                  if lb.get("transport") == transport})
    buckets = [(le, diff("xllm:kv_transfer_seconds_bucket", transport=transport, le=_le(le))) for le in les]
    n = diff("xllm:kv_transfer_seconds_count", transport=transport)
    breakdown = {}
    for phase in PHASES:
        count = diff("xllm:pd_ttft_breakdown_seconds_count", phase=phase)
        breakdown[phase] = diff("xllm:pd_ttft_breakdown_seconds_sum", phase=phase) / count * 1e3 if count else None
    return {
        "transfers": n,
        "bytes_per_request": diff("xllm:kv_transfer_bytes_total", transport=transport) / n if n else None,
        "transfer_ms_mean": diff("xllm:kv_transfer_seconds_sum", transport=transport) / n * 1e3 if n else None,
        "transfer_ms_p50": histogram_quantile(buckets, 0.5) * 1e3,
        "transfer_ms_p99": histogram_quantile(buckets, 0.99) * 1e3,
        "transfer_failures": diff("xllm:kv_transfer_failures_total", transport=transport),
        "prefill_retries": diff("xllm:pd_prefill_retries_total"),
        "ttft_breakdown_ms_mean": breakdown,
        "requests": requests,
    }


def _le(value: float) -> str:
    return "+Inf" if math.isinf(value) else repr(value)


# ---- running ------------------------------------------------------------------------------------

def serve_args(config: str) -> list[str]:
    if config == "mixed":
        return ["--instances", "2"]
    if config == "mixed-chunked":
        return ["--instances", "2", "--max-num-batched-tokens", str(CHUNKED)]
    transport = config.removeprefix("pd-")
    args = ["--prefill-instances", "1", "--decode-instances", "1", "--kv-transfer", transport]
    if transport == "mooncake":  # hand-offs through the engines' T3 tier: a store `xllm serve` starts and stops
        args += ["--kv-store", "local-mooncake"]
    return args


def run_config(config: str, args: argparse.Namespace, model_dir: pathlib.Path, workload: Workload,
               warmup: list[RequestSpec], out: pathlib.Path) -> dict:
    import asyncio

    import httpx

    from benchmarks.peers.venv import ServerProcess, free_port

    port = free_port()
    cmd = [sys.executable, "-m", "xllm.gateway", "serve", "--model", str(model_dir), "--port", str(port),
           "--dtype", args.dtype, "--threads", "1", "--kv-cache-memory", str(args.kv_cache_memory),
           "--max-num-seqs", str(args.max_num_seqs), "--no-progress", "--log-level", "warning",
           *serve_args(config)]
    server = ServerProcess(f"xllm-{config}", cmd, port, out / "logs" / f"serve-{config}.log", health_path="/health")
    profile = EndpointProfile()
    with server:
        wait_instances(server.base_url, 2)
        model = httpx.get(server.base_url + "/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
        asyncio.run(run_requests(server.base_url, model, warmup, profile))
        before = scrape(server.base_url)
        records, duration = asyncio.run(run_requests(server.base_url, model, workload.specs, profile, desc=config))
        after = scrape(server.base_url)
    slo = SLO(tpot_ms=args.slo_tpot_ms)
    run = {
        "summary": serving_summary(records, duration, slo),
        "long": serving_summary([r for r, lg in zip(records, workload.long) if lg], duration),
        "short": serving_summary([r for r, lg in zip(records, workload.long) if not lg], duration),
        "startup_s": server.startup_seconds,
        "records": [r.to_dict() for r in records],
    }
    if config.startswith("pd-"):
        run["pd"] = pd_figures(before, after, config.removeprefix("pd-"), len(records))
    s = run["summary"]
    print(f"[pd] {config}: TTFT p50 {s['ttft_ms']['p50']:.0f} p99 {s['ttft_ms']['p99']:.0f} ms, TPOT p50 "
          f"{s['tpot_ms']['p50']:.1f} p99 {s['tpot_ms']['p99']:.1f} ms, goodput {s['goodput']:.3f} req/s, "
          f"failed {s['failed']}", flush=True)
    return run


# ---- report -------------------------------------------------------------------------------------

def _f(x, digits: int = 0) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ratio(a, b) -> str:
    r = ratio(a, b)
    return "–" if r is None else f"{r:.2f}x"


def _slo_figures(run: dict, tpot_ms: float) -> tuple[float, float]:
    """(SLO attainment, goodput) of a run under a TPOT objective, from its requests."""
    records = [_record(r) for r in run["records"]]
    slo = SLO(tpot_ms=tpot_ms)
    return slo_attainment(records, slo), goodput(records, slo, run["summary"]["duration_s"])


def markdown(runs: dict[str, dict], meta: dict, errors: dict[str, str]) -> str:
    slo_ms = meta["slo_tpot_ms"]
    lines = [
        f"# PD disaggregation: 1 prefill + 1 decode vs 2 mixed instances ({meta['model']}, {meta['dtype']})",
        "",
        f"{meta['requests']} requests, Poisson {meta['rate']} req/s; {meta['long_fraction']:.0%} with "
        f"{meta['long_prompt_len']}-token prompts, the rest {meta['short_prompt_len']}; {meta['output_len']} output "
        f"tokens each; one thread per engine process, KV cache {meta['kv_cache_memory']} GiB each. SLO: TPOT <= "
        f"{meta['slo_tpot_ms']:g} ms. CPU busy before/after: {pct(meta.get('cpu_busy_before'))} / "
        f"{pct(meta.get('cpu_busy_after'))}.",
        "",
        "| config | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) | long-prompt TTFT p50 | "
        "short-prompt TTFT p50 | SLO attainment | goodput (req/s) | output tok/s | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in runs.items():
        s = run["summary"]
        attained, good = _slo_figures(run, slo_ms)
        lines.append(
            f"| {name} | {_f(s['ttft_ms']['p50'])} | {_f(s['ttft_ms']['p99'])} | {_f(s['tpot_ms']['p50'], 1)} | "
            f"{_f(s['tpot_ms']['p99'], 1)} | {_f(run['long']['ttft_ms']['p50'])} | "
            f"{_f(run['short']['ttft_ms']['p50'])} | {attained:.0%} | {good:.3f} | "
            f"{s['output_throughput']:.1f} | {s['failed']} |")
    base = runs.get("mixed")
    pd_runs = {k: v for k, v in runs.items() if k.startswith("pd-") and "pd" in v}
    if base is not None and len(runs) > 1:
        lines += ["", "Ratios over mixed (below 1 is better for latencies, above 1 for goodput):", "",
                  "| config | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | goodput |",
                  "| --- | --- | --- | --- | --- | --- |"]
        b, b_good = base["summary"], _slo_figures(base, slo_ms)[1]
        for name, run in runs.items():
            if name == "mixed":
                continue
            s, good = run["summary"], _slo_figures(run, slo_ms)[1]
            lines.append(f"| {name} | {_ratio(s['ttft_ms']['p50'], b['ttft_ms']['p50'])} | "
                         f"{_ratio(s['ttft_ms']['p99'], b['ttft_ms']['p99'])} | "
                         f"{_ratio(s['tpot_ms']['p50'], b['tpot_ms']['p50'])} | "
                         f"{_ratio(s['tpot_ms']['p99'], b['tpot_ms']['p99'])} | {_ratio(good, b_good)} |")
    if pd_runs:
        lines += ["", "KV hand-offs (from the gateway's /metrics). Transfer time = the decode side's wall time from "
                  "the first byte to the KV checked (grpc starts with the prefill's last forward, so most of it "
                  "overlaps the prefill); p50/p99 interpolated from the histogram buckets. The breakdown's "
                  "transfer is the part the prefill did not hide:", "",
                  "| config | KV per request (MiB) | transfer mean (ms) | p50 | p99 | failures | prefill retries | "
                  "TTFT breakdown mean: queue / prefill / transfer / first decode (ms) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, run in pd_runs.items():
            p = run["pd"]
            br = " / ".join(_f(p["ttft_breakdown_ms_mean"][ph]) for ph in PHASES)
            mib = None if p["bytes_per_request"] is None else p["bytes_per_request"] / 2**20
            lines.append(f"| {name} | {_f(mib, 1)} | {_f(p['transfer_ms_mean'], 1)} | {_f(p['transfer_ms_p50'], 1)} | "
                         f"{_f(p['transfer_ms_p99'], 1)} | {p['transfer_failures']:.0f} | {p['prefill_retries']:.0f} | "
                         f"{br} |")
    if runs:
        lines += ["", "Goodput (req/s meeting the TPOT objective) as the objective tightens (from every request's "
                  "own TPOT):", "", "| config | " + " | ".join(f"TPOT <= {t} ms" for t in GOODPUT_TPOT_MS) + " |",
                  "| --- |" + " --- |" * len(GOODPUT_TPOT_MS)]
        for name, run in runs.items():
            duration = run["summary"]["duration_s"]
            records = [_record(r) for r in run["records"]]
            cells = [f"{goodput(records, SLO(tpot_ms=t), duration):.3f}" for t in GOODPUT_TPOT_MS]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, err in errors.items():
        lines.append(f"\n**{name} failed**: {err}")
    return "\n".join(lines) + "\n"


def _record(d: dict) -> RequestRecord:
    return RequestRecord(**{f.name: d[f.name] for f in fields(RequestRecord) if f.name in d})


def plot(runs: dict[str, dict], path: pathlib.Path) -> None:
    """TPOT and TTFT CDFs per configuration, and the p50/p99 bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, run in runs.items():
        for ax, key in ((axes[0], "tpot"), (axes[1], "ttft")):
            xs = sorted(r[key] * 1e3 for r in run["records"] if r.get(key) is not None)
            if xs:
                ax.step([xs[0], *xs], [0.0] + [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    for ax, title in ((axes[0], "TPOT per request (ms)"), (axes[1], "TTFT (ms)")):
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_xscale("log")
    names = list(runs)
    width = 0.2
    for i, (label, key, q) in enumerate((("TPOT p50", "tpot_ms", "p50"), ("TPOT p99", "tpot_ms", "p99"))):
        axes[2].bar([j + i * width for j in range(len(names))], [runs[n]["summary"][key][q] for n in names], width,
                    label=label)
    axes[2].set_xticks([j + width / 2 for j in range(len(names))], names)
    axes[2].set_ylabel("ms")
    axes[2].set_title("TPOT percentiles")
    axes[2].legend(fontsize=8)
    axes[2].grid(True, axis="y", alpha=0.3)
    fig.suptitle("PD disaggregation vs mixed instances")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--requests", type=int, default=40, help="requests in the measured run (40)")
    p.add_argument("--rate", type=float, default=0.2, help="Poisson arrival rate, req/s (0.2)")
    p.add_argument("--long-fraction", type=float, default=0.5, help="share of requests with a long prompt (0.5)")
    p.add_argument("--long-prompt-len", type=int, default=2048, help="tokens of a long prompt (2048)")
    p.add_argument("--short-prompt-len", type=int, default=128, help="tokens of a short prompt (128)")
    p.add_argument("--output-len", type=int, default=192, help="output tokens of every request (192)")
    p.add_argument("--slo-tpot-ms", type=float, default=35.0,
                   help="TPOT objective of the goodput column and ratio, ms (35: ~1.5x this machine's unloaded TPOT "
                        "of SmolLM2; the goodput table also shows 25/50/100)")
    p.add_argument("--kv-cache-memory", type=float, default=1.0, metavar="GIB", help="KV cache per instance (1.0)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled SmolLM2)")
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p, "pd")


def summary(results: dict) -> str:
    return markdown(results["runs"], results["meta"], results["errors"])


def plot_png(results: dict, out: pathlib.Path) -> None:
    if results["runs"]:
        plot(results["runs"], out / "pd.png")


def reload(results: dict, args: argparse.Namespace) -> None:
    """``--report DIR --slo-tpot-ms X``: the goodput column against another objective than the run's."""
    results["meta"]["slo_tpot_ms"] = args.slo_tpot_ms


def run(args: argparse.Namespace, output: Output) -> dict | int:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not 0 <= args.long_fraction <= 1 or args.requests < 1 or args.rate <= 0:
        print(f"python -m benchmarks pd: error: bad configs {bad} or workload settings", file=sys.stderr)
        return 2
    from benchmarks.machine import cpu_busy_fraction
    from benchmarks.prompts import PromptBank

    model_dir = xllm_model_dir(args.model)
    out = output.open()
    bank = PromptBank(model_dir)
    workload = build_workload(bank, args)
    rng = random.Random(args.seed + 1)
    warmup = [RequestSpec(bank.prompt(n, rng).ids, "", 4) for n in (300, 32, 300, 32)]
    meta = output.meta(args, model=model_dir.name)
    meta["long"] = workload.long
    print(f"[pd] {len(workload.specs)} requests ({sum(workload.long)} long), configs {', '.join(configs)}; "
          f"results in {out}", flush=True)
    results: dict = {"meta": meta, "runs": {}, "errors": {}}
    for config in configs:
        r = attempt(results["errors"], config, "pd", run_config, config, args, model_dir, workload, warmup, out,
                    limit=500)
        if r is not None:
            results["runs"][config] = r
        output.save(results)
    meta["cpu_busy_after"] = cpu_busy_fraction()
    return results


SCENARIO = Scenario("pd", "1 prefill + 1 decode vs 2 mixed instances, per KV transport", __doc__, add_arguments, run,
                    summary, plot_png, reload)
