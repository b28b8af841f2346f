"""Elastic scheduling, live: online/offline co-location on and off (and static vs dynamic PD roles).

    python -m benchmarks elastic                              # every case (PD ones when `xllm serve` has them)
    python -m benchmarks elastic --cases online-only,colocation-on --rate 1.5 --slo-tpot-ms 80
    python -m benchmarks elastic --quick --model DIR          # a few requests: checks the code path only
    python -m benchmarks elastic --report benchmarks/results/elastic-20261123-101500   # rebuild summary + plot

An **online** stream (``--online-requests`` at ``--rate`` req/s, Poisson: steady) carries the latency
objectives (``--slo-ttft-ms``, ``--slo-tpot-ms``, passed to the server too); an **offline backlog**
(``--offline-requests``, all sent at the start, longer prompts and outputs) is the work co-location
should soak up. The co-location cases, each on a fresh ``xllm serve`` (one engine):

- ``online-only``: the online stream alone, the baseline;
- ``colocation-off``: the stream plus the backlog sent as ordinary requests (everything online);
- ``colocation-on``: the stream plus the backlog as ``service_tier: "flex"`` (offline: admitted into
  steps only within the TPOT SLO by the engine's step-time prediction, preempted for online requests;
  ``xllm.sched.colocation``).

The PD cases (``pd-static``, ``pd-dynamic``: ``--prefill-instances 1 --decode-instances 2 --pd-policy
static|dynamic`` with flip windows and cool-downs of seconds, the machine's threads split over the
engines) run the online stream with bursty arrivals (Gamma, ``--cv``),
where role flips should pay; they are listed only when ``xllm serve`` has ``--pd-policy``. A new case
is one :class:`Case` in :data:`CASES`.

Reported per case: the online requests' SLO attainment (TTFT, TPOT, both), TTFT/TPOT p50/p99; the
offline backlog's output tokens streamed while the online stream ran (tok/s in that window), its
makespan and overall tok/s; from ``/metrics``: offline preemptions by reason, the longest offline wait.
Results: ``results.json``, ``summary.md`` and ``elastic.png`` in ``--out`` (default
``benchmarks/results/elastic-<timestamp>``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import pathlib
import random
import sys
from dataclasses import dataclass

from benchmarks.client import EndpointProfile, RequestSpec, run_requests
from benchmarks.report import add_output_args, pct
from benchmarks.scenario import Output, Scenario, attempt
from benchmarks.stats import SLO, RequestRecord, serving_summary, slo_attainment

PREEMPTION_REASONS = ("kv", "batch_full", "slo")


@dataclass(frozen=True)
class Case:
    """One configuration: ``xllm serve`` flags beyond the common ones, how the offline backlog is sent
    (``"flex"``, ``"online"``: without a tier, ``None``: not at all), engine processes, and whether the
    online stream arrives steadily (Poisson) or in bursts (Gamma with ``--cv``)."""

    name: str
    serve_flags: tuple[str, ...] = ()
    offline: str | None = None
    instances: int = 1
    bursty: bool = False
    description: str = ""


CASES: dict[str, Case] = {c.name: c for c in (
    Case("online-only", description="the online stream alone (baseline)"),
    Case("colocation-off", offline="online", description="online stream + offline backlog as ordinary requests"),
    Case("colocation-on", offline="flex", description="online stream + offline backlog as service_tier flex"),
    # 1 prefill + 2 decode: with --pd-min-per-role 1 a decode instance is the one that can flip; windows and
    # cool-downs scaled to a one-minute stream (the defaults are for long-running clusters)
    *(Case(f"pd-{policy}", ("--prefill-instances", "1", "--decode-instances", "2", "--pd-policy", policy,
                            "--pd-flip-window", "2", "--pd-flip-cooldown", "5", "--pd-cluster-cooldown", "3"),
           instances=3, bursty=True, description=f"1 prefill + 2 decode instances, --pd-policy {policy}, bursty "
                                                 f"online stream") for policy in ("static", "dynamic")),
)}


def serve_supports(flag: str) -> bool:
    """Whether ``xllm serve`` has ``flag`` (the PD cases need H4's ``--pd-policy``)."""
    from xllm.gateway.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    return any(flag in a.option_strings for a in serve._actions)


def available_cases() -> list[str]:
    pd = serve_supports("--pd-policy")
    return [name for name, c in CASES.items() if pd or "--pd-policy" not in c.serve_flags]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", default=None,
                   help=f"comma-separated cases (of: {', '.join(CASES)}; default: every available one, "
                        f"co-location only with --quick)")
    p.add_argument("--online-requests", type=int, default=48, help="requests of the online stream")
    p.add_argument("--rate", type=float, default=1.0, help="online arrival rate, req/s")
    p.add_argument("--cv", type=float, default=3.0, help="bursty cases: the Gamma arrivals' coefficient of variation")
    p.add_argument("--online-prompt-len", type=int, default=128)
    p.add_argument("--online-output-len", type=int, default=64)
    p.add_argument("--offline-requests", type=int, default=32, help="requests of the offline backlog")
    p.add_argument("--offline-prompt-len", type=int, default=256)
    p.add_argument("--offline-output-len", type=int, default=128)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="online TTFT objective (ms), also the server's")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="online TPOT objective (ms), also the server's")
    p.add_argument("--starvation-s", type=float, default=30.0, help="the server's --offline-starvation-s")
    p.add_argument("--threads", type=int, default=2, help="threads of the machine given to the server (split "
                                                           "among its engine processes)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="the server's --max-num-seqs")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled SmolLM2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--xllm-args", default="", metavar="'FLAGS'", help="more flags for every server (e.g. --profile F)")
    p.add_argument("--quick", action="store_true",
                   help="a handful of short requests per case (tests the code path; the figures mean nothing)")
    add_output_args(p, "elastic")


def quick(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "online_requests": 4, "rate": 4.0, "online_prompt_len": 16,
                                 "online_output_len": 6, "offline_requests": 3, "offline_prompt_len": 24,
                                 "offline_output_len": 8, "max_num_seqs": 4})


# ---- workload -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    online: list[RequestSpec]
    offline: list[RequestSpec]


def build_workload(bank, args: argparse.Namespace, bursty: bool) -> Workload:
    """The online stream (Poisson, or Gamma with ``args.cv`` when ``bursty``) and the offline backlog
    (all at t = 0), with prompts of the given lengths drawn from ``bank``; the same for every case."""
    from benchmarks.workload import gamma_arrivals, poisson_arrivals

    rng = random.Random(args.seed)
    arrivals = (gamma_arrivals(args.rate, args.cv, args.online_requests, args.seed) if bursty
                else poisson_arrivals(args.rate, args.online_requests, args.seed))
    online = []
    for t in arrivals:
        p = bank.prompt(args.online_prompt_len, rng)
        online.append(RequestSpec(p.ids, p.text, args.online_output_len, t))
    offline = []
    for _ in range(args.offline_requests):
        p = bank.prompt(args.offline_prompt_len, rng)
        offline.append(RequestSpec(p.ids, p.text, args.offline_output_len, 0.0))
    return Workload(online, offline)


def chunk_times(r: RequestRecord) -> list[float]:
    """When each streamed chunk of ``r`` arrived, seconds after the run's start."""
    if r.ttft is None:
        return []
    t = r.start + r.ttft
    out = [t]
    for gap in r.itls:
        t += gap
        out.append(t)
    return out


def offline_figures(records: list[RequestRecord], window: float) -> dict:
    """The backlog's tokens streamed within the first ``window`` seconds (the online stream's run) and
    overall. Chunks are counted as tokens inside the window (a chunk holds one token but for held-back
    text); totals come from usage."""
    ok = [r for r in records if r.success]
    in_window = sum(1 for r in ok for t in chunk_times(r) if t <= window)
    makespan = max((r.start + r.e2e for r in ok if r.e2e is not None), default=0.0)
    tokens = sum(r.output_tokens for r in ok)
    return {"requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
            "tokens_in_window": in_window, "window_s": window,
            "tok_s_in_window": in_window / window if window > 0 else math.nan,
            "output_tokens": tokens, "makespan_s": makespan,
            "tok_s_overall": tokens / makespan if makespan > 0 else math.nan}


def scheduler_figures(before: dict, after: dict) -> dict:
    """What the engines' co-location counters did between two ``/metrics`` scrapes."""
    from benchmarks.metrics import total

    def diff(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    return {"offline_preemptions": {r: diff("xllm:offline_preemptions_total", reason=r) for r in PREEMPTION_REASONS},
            "preemptions": diff("xllm:num_preemptions_total"),
            "offline_generation_tokens": diff("xllm:offline_generation_tokens_total"),
            "offline_longest_wait_s": max((v for _, v in after.get("xllm:offline_longest_wait_seconds", [])),
                                          default=0.0),
            "role_flips": diff("xllm:pd_role_flips_total")}


# ---- running ----------------------------------------------------------------------------------------

def serve_command(case: Case, args: argparse.Namespace, model_dir: pathlib.Path, port: int) -> list[str]:
    threads = max(1, args.threads // case.instances)
    return [sys.executable, "-m", "xllm.gateway", "serve", "--model", str(model_dir), "--port", str(port),
            "--dtype", args.dtype, "--threads", str(threads), "--max-num-seqs", str(args.max_num_seqs),
            "--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.slo_tpot_ms:g}",
            "--offline-starvation-s", f"{args.starvation_s:g}", "--no-progress", "--log-level", "warning",
            *case.serve_flags, *args.xllm_args.split()]


def backlog_profile(case: Case) -> EndpointProfile:
    """How the backlog is sent in ``case``."""
    tier = {"service_tier": "flex"} if case.offline == "flex" else {}
    return EndpointProfile(extra_body={"ignore_eos": True, **tier})


async def _both(base_url: str, model: str, work: Workload, case: Case):
    online = run_requests(base_url, model, work.online, EndpointProfile(), desc=f"{case.name} online")
    if case.offline is None:
        return await online, ([], 0.0)
    offline = run_requests(base_url, model, work.offline, backlog_profile(case))
    return tuple(await asyncio.gather(online, offline))


def run_case(case: Case, args: argparse.Namespace, model_dir: pathlib.Path, work: Workload,
             warmup: list[RequestSpec], out: pathlib.Path) -> dict:
    import httpx

    from benchmarks.metrics import scrape
    from benchmarks.peers.venv import ServerProcess, free_port
    from benchmarks.peers.xllm import wait_instances

    port = free_port()
    server = ServerProcess(f"xllm-{case.name}", serve_command(case, args, model_dir, port), port,
                           out / "logs" / f"serve-{case.name}.log", health_path="/health")
    with server:
        wait_instances(server.base_url, case.instances)
        model = httpx.get(server.base_url + "/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
        # warm-up: kernels, and enough steps for the engine's step-time model (xllm.core.step_timing)
        asyncio.run(run_requests(server.base_url, model, warmup, EndpointProfile()))
        before = scrape(server.base_url)
        (online, duration), (offline, _) = asyncio.run(_both(server.base_url, model, work, case))
        after = scrape(server.base_url)
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    run = {
        "case": case.name, "description": case.description, "serve_flags": list(case.serve_flags),
        "online": serving_summary(online, duration, slo),
        "attainment": {"ttft": slo_attainment(online, SLO(ttft_ms=args.slo_ttft_ms)),
                       "tpot": slo_attainment(online, SLO(tpot_ms=args.slo_tpot_ms)),
                       "both": slo_attainment(online, slo)},
        "offline": offline_figures(offline, duration) if case.offline else None,
        "scheduler": scheduler_figures(before, after),
        "startup_s": server.startup_seconds,
        "records": {"online": [r.to_dict() for r in online], "offline": [r.to_dict() for r in offline]},
    }
    a, s = run["attainment"], run["online"]
    off = run["offline"]
    print(f"[elastic] {case.name}: online SLO {a['both']:.0%} (TTFT {a['ttft']:.0%}, TPOT {a['tpot']:.0%}), TTFT p50 "
          f"{s['ttft_ms']['p50']:.0f} ms, TPOT p50 {s['tpot_ms']['p50']:.1f} ms"
          + (f"; offline {off['tok_s_in_window']:.1f} tok/s in the online window, {off['tok_s_overall']:.1f} "
             f"overall" if off else ""), flush=True)
    return run


# ---- report -------------------------------------------------------------------------------------------

def _f(x, digits: int = 0) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"# Elastic scheduling: online/offline co-location, PD roles (commit {meta.get('commit')})", "",
             f"Online: {meta['online_requests']} requests at {meta['rate']:g} req/s, {meta['online_prompt_len']}-token "
             f"prompts, {meta['online_output_len']} output tokens; SLO TTFT <= {meta['slo_ttft_ms']:g} ms, TPOT <= "
             f"{meta['slo_tpot_ms']:g} ms. Offline backlog: {meta['offline_requests']} requests, "
             f"{meta['offline_prompt_len']}-token prompts, {meta['offline_output_len']} output tokens, all at the "
             f"start. {meta['dtype']}, {meta['threads']} threads, --max-num-seqs {meta['max_num_seqs']}. CPU busy "
             f"before/after: {pct(meta.get('cpu_busy_before'))} / {pct(meta.get('cpu_busy_after'))}"
             + (" (QUICK MODE: the figures mean nothing)" if meta.get("quick") else "") + ".", "",
             "| case | online SLO (both) | TTFT ok | TPOT ok | TTFT p50 / p99 ms | TPOT p50 / p99 ms | offline tok/s "
             "in online window | offline tok/s overall | offline makespan s | offline preemptions kv / batch_full / "
             "slo | longest offline wait s | PD role flips | failed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, run in results["runs"].items():
        a, s, off, sch = run["attainment"], run["online"], run["offline"], run["scheduler"]
        pre = sch["offline_preemptions"]
        failed = s["failed"] + (off["failed"] if off else 0)
        lines.append(
            f"| {name} | {pct(a['both'])} | {pct(a['ttft'])} | {pct(a['tpot'])} | {_f(s['ttft_ms']['p50'])} / "
            f"{_f(s['ttft_ms']['p99'])} | {_f(s['tpot_ms']['p50'], 1)} / {_f(s['tpot_ms']['p99'], 1)} | "
            f"{_f(off and off['tok_s_in_window'], 1)} | {_f(off and off['tok_s_overall'], 1)} | "
            f"{_f(off and off['makespan_s'], 1)} | {pre['kv']:.0f} / {pre['batch_full']:.0f} / {pre['slo']:.0f} | "
            f"{_f(sch['offline_longest_wait_s'], 1)} | {_f(sch.get('role_flips'))} | {failed} |")
    if results.get("errors"):
        lines += ["", "Errors:", ""] + [f"- {k}: {v}" for k, v in results["errors"].items()]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["runs"])
    runs = [results["runs"][n] for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(names, [100 * r["attainment"]["both"] for r in runs])
    axes[0].set_ylabel("online SLO attainment (%)")
    axes[1].bar(names, [(r["offline"] or {}).get("tok_s_in_window") or 0 for r in runs])
    axes[1].set_ylabel("offline tok/s while the online stream ran")
    for ax in axes:
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_png(results: dict, out: pathlib.Path) -> None:
    if results["runs"]:
        plot(results, out / "elastic.png")


# ---- run ----------------------------------------------------------------------------------------------

def run(args: argparse.Namespace, output: Output) -> dict | int:
    if args.quick:
        args = quick(args)
    available = available_cases()
    default = [n for n in available if not n.startswith("pd-")] if args.quick else available
    names = [n for n in (args.cases.split(",") if args.cases else default) if n]
    unknown = [n for n in names if n not in available]
    if unknown:
        print(f"python -m benchmarks elastic: error: unknown or unavailable case(s) {unknown}; available: "
              f"{', '.join(available)}", file=sys.stderr)
        return 2
    from benchmarks.machine import cpu_busy_fraction
    from benchmarks.peers.xllm import model_dir as xllm_model_dir
    from benchmarks.prompts import PromptBank

    model_dir = xllm_model_dir(args.model).resolve()
    out = output.open(resolve=True)
    bank = PromptBank(model_dir)
    warm_rng = random.Random(args.seed + 1)
    warm_n, warm_len = (2, 8) if args.quick else (12, 48)
    warmup = [RequestSpec(p.ids, p.text, warm_len) for p in (bank.prompt(warm_len, warm_rng) for _ in range(warm_n))]
    meta = output.meta(args, argv=False, busy=not args.quick, cases=names, model=model_dir.name)
    if args.quick:
        meta["cpu_busy_before"] = None
    results: dict = {"meta": meta, "runs": {}, "errors": {}}
    workloads = {bursty: build_workload(bank, args, bursty) for bursty in {CASES[n].bursty for n in names}}
    for name in names:
        case = CASES[name]
        r = attempt(results["errors"], name, "elastic", run_case, case, args, model_dir, workloads[case.bursty],
                    warmup, out, limit=1500)
        if r is not None:
            results["runs"][name] = r
        output.save(results)
    results["meta"]["cpu_busy_after"] = None if args.quick else cpu_busy_fraction()
    return results


SCENARIO = Scenario("elastic", "online/offline co-location on/off, static vs dynamic PD", __doc__.split("\n\n")[0],
                    add_arguments, run, markdown, plot_png)
