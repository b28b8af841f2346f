"""Cluster-scale ablations in the simulator (``xllm-sim``): the real xllm-sched policies on hundreds
of simulated instances, step times from the engine's profile.

    python -m benchmarks sim                                  # 200 instances, 100k-request confirm runs
    python -m benchmarks sim --tiny                           # 8 instances, 400 requests: the code path
    python -m benchmarks sim --parts pd --workload gamma      # plain bursty traffic, fixed length mix
    python -m benchmarks sim --report benchmarks/results/sim-20261123-030000

**PD (xLLM §3.2: 1.67x the request rate of minimal-load on a bursty trace).** The default workload
(``--workload phases``) is bursty (Gamma arrivals, ``--cv``) and shifts between prefill-heavy and
decode-heavy periods (``--phase-s``, ``--prefill-mix``, ``--decode-mix``), as the report's bursty
traces do: dynamic PD can only gain when the prefill/decode balance of the load changes over time
(``--workload gamma``: one fixed length mix, ``--prompt-len``/``--output-len``). Clusters of
``--instances`` instances, half prefill and half decode at the start (``--configs``, of
:data:`PD_CONFIGS`): ``dynamic`` (the gateway's defaults: ``--pd-policy dynamic`` with KV-aware
routing, up to ``--pd-batch`` flips per decision, and prefill overflow onto decode instances when
every prefill instance would miss the TTFT objective: xLLM's SLO-aware policy), ``dynamic-no-overflow``
(its flips alone), ``static-overflow`` (its placement alone: roles fixed), ``static`` (roles fixed,
KV-aware routing) and ``minimal-load`` (roles fixed, least-load routing of the prefill side: the
report's baseline); ``dynamic-one-flip`` (one flip per decision, ``--pd-max-in-progress`` under way)
on request. For each, the highest request rate whose SLO attainment
(TTFT ≤ ``--slo-ttft-ms`` and TPOT ≤ ``--slo-tpot-ms``) stays ≥ ``--target`` is searched on
``--search-requests`` requests per probe: the rate doubles (or halves) from a capacity estimate
until it brackets the target, then ``--probes`` bisection steps. The rate found is then confirmed
with one run of ``--requests`` requests (stepped down by the last bracket's ratio, at most
``--confirm-retries`` times, while it misses the target): **the reported max rate and attainment are
the confirm run's**. Reported: each configuration's confirmed max rate, its ratio to minimal-load
and to static, attainment, role flips, and every probe and confirm run with its wall and CPU time.

**Co-location (xLLM §3.1).** ``--instances`` mixed instances on Gamma traffic of the fixed mix
(``--prompt-len``/``--output-len``): the highest rate within the SLO is searched (``--search-requests``
per probe, ``--probes`` − 2 bisections); then an online stream of ``--requests`` requests at
``--colo-load`` × that rate, plus as many offline requests again (``service_tier: flex``).
``decode_first`` treats both alike; ``colocation`` (the engine's co-location policy) admits offline
work only within the TPOT objective and preempts it for online requests. Reported: online SLO
attainment and latency, offline output tokens/s, against online-only.

Results: ``results.json``, ``summary.md`` and ``sim.png`` in ``--out`` (default
``benchmarks/results/sim-<timestamp>``). Every run is a pure-Python simulation (no model, no
server); the wall and CPU time of each is recorded.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
import time

from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario, flag_values

PD_CONFIGS = {  # name -> (pd policy, routing policy, flips per decision: 1, or "batch": --pd-batch, by
    # default a tenth of the instances as the gateway's default --pd-max-flips; prefill overflow onto
    # decode instances: PDPlacement with the TTFT objective, the gateway's --pd-prefill-overflow)
    "dynamic": ("dynamic", "kv_aware", "batch", True),          # the gateway's defaults
    "dynamic-no-overflow": ("dynamic", "kv_aware", "batch", False),
    "static-overflow": ("static", "kv_aware", 1, True),
    "static": ("static", "kv_aware", 1, False),
    "minimal-load": ("static", "least_load", 1, False),
    "dynamic-one-flip": ("dynamic", "kv_aware", 1, False),     # the gateway's defaults before batched flips
}
DEFAULT_PD_CONFIGS = ("dynamic", "dynamic-no-overflow", "static-overflow", "static", "minimal-load")
PARTS = ("pd", "colocation")
WORKLOADS = ("phases", "gamma")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from xllm.sim.cli import length_mix, phase_seconds
    from xllm.sim.trace import DECODE_HEAVY, PREFILL_HEAVY

    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--instances", type=int, default=200, help="instances per cluster (200)")
    p.add_argument("--requests", type=int, default=100_000,
                   help="requests of each confirm run (PD) and online requests of each co-location run (100000)")
    p.add_argument("--search-requests", type=int, default=20_000,
                   help="requests per probe of the max-rate searches (20000)")
    p.add_argument("--confirm-retries", type=int, default=2,
                   help="PD: times a confirm run that misses the target is retried at a lower rate (2)")
    p.add_argument("--tiny", action="store_true",
                   help="8 instances, 400 requests (200 per probe), 2 probes, 15 s phases: check the code path")
    p.add_argument("--workload", default="phases", choices=WORKLOADS,
                   help="PD workload: phases (prefill-heavy and decode-heavy periods alternate) or gamma "
                        "(one fixed mix) (phases)")
    p.add_argument("--cv", type=float, default=4.0, help="burstiness: CV of the Gamma inter-arrival gaps (4)")
    p.add_argument("--phase-s", type=phase_seconds, default=(60.0, 60.0), metavar="P[,D]",
                   help="phases: seconds of each prefill-heavy and each decode-heavy period (60,60)")
    p.add_argument("--prefill-mix", type=length_mix, default=PREFILL_HEAVY, metavar="PROMPT,OUTPUT",
                   help=f"phases: prefill-heavy length specs ({','.join(PREFILL_HEAVY)})")
    p.add_argument("--decode-mix", type=length_mix, default=DECODE_HEAVY, metavar="PROMPT,OUTPUT",
                   help=f"phases: decode-heavy length specs ({','.join(DECODE_HEAVY)})")
    p.add_argument("--prompt-len", default="lognormal:512:0.8:4096",
                   help="gamma workload and co-location: prompt length spec (xllm-sim syntax)")
    p.add_argument("--output-len", default="lognormal:128:0.8:1024",
                   help="gamma workload and co-location: output length spec")
    p.add_argument("--prefix-groups", type=int, default=50, help="shared system prompts (50)")
    p.add_argument("--prefix-len", type=int, default=128, help="tokens of a shared system prompt (128)")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="TTFT objective, ms (default: 4x the profile's prefill time of a mean prompt)")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="TPOT objective, ms (default: 1.5x the profile's decode step of 32 mean sequences)")
    p.add_argument("--target", type=float, default=0.9, help="SLO attainment a rate must keep (0.9)")
    p.add_argument("--probes", type=int, default=5, help="bisection steps after bracketing (5)")
    p.add_argument("--pd-flip-window", type=float, default=5.0,
                   help="dynamic: seconds a pressure must hold before it flips (5, the gateway's)")
    p.add_argument("--pd-flip-cooldown", type=float, default=30.0,
                   help="dynamic: seconds between two flips of one instance (30, the gateway's)")
    p.add_argument("--pd-cluster-cooldown", type=float, default=10.0,
                   help="dynamic: seconds between two flip decisions of the cluster (10, the gateway's)")
    p.add_argument("--pd-max-in-progress", type=int, default=1,
                   help="dynamic-one-flip: flips under way at once (default 1)")
    p.add_argument("--pd-batch", type=int, default=None,
                   help="dynamic, dynamic-no-overflow: instances one decision may flip together, and flips under way "
                        "at once "
                        "(default: a tenth of --instances, the gateway's default --pd-max-flips)")
    p.add_argument("--configs", default=",".join(DEFAULT_PD_CONFIGS),
                   help=f"PD configurations to run, comma-separated, of {', '.join(PD_CONFIGS)} "
                        f"(default {','.join(DEFAULT_PD_CONFIGS)})")
    p.add_argument("--jobs", type=int, default=1,
                   help="PD configurations (and co-location runs) simulated in parallel processes (1)")
    p.add_argument("--colo-max-rate", type=float, default=None,
                   help="co-location: the mixed cluster's max rate within the SLO, req/s, when already known "
                        "(skips its search)")
    p.add_argument("--colo-load", type=float, default=0.6,
                   help="co-location: the online rate as a fraction of the mixed cluster's max rate (0.6)")
    p.add_argument("--profile", type=pathlib.Path, default=None, help="step-time profile (default: xllm-sim's)")
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p, "sim")


# ---- running ---------------------------------------------------------------------------------------

def base_config(args: argparse.Namespace):
    from xllm.sim import SimConfig

    return SimConfig(slo_ttft_s=args.slo_ttft_ms / 1e3, slo_tpot_s=args.slo_tpot_ms / 1e3,
                     pd_window_s=args.pd_flip_window, pd_cooldown_s=args.pd_flip_cooldown,
                     pd_cluster_cooldown_s=args.pd_cluster_cooldown, pd_max_in_progress=args.pd_max_in_progress)


def workload(args: argparse.Namespace, rate: float, offline_fraction: float = 0.0, kind: str | None = None):
    """The Workload at ``rate``: ``kind`` (default ``args.workload``) phases or gamma."""
    from xllm.sim import Workload

    return Workload(arrivals=kind or args.workload, rate=rate, cv=args.cv, prompt=args.prompt_len,
                    output=args.output_len, prefix_groups=args.prefix_groups, prefix_len=args.prefix_len,
                    offline_fraction=offline_fraction, phase_s=tuple(args.phase_s), prefill_mix=tuple(args.prefill_mix),
                    decode_mix=tuple(args.decode_mix))


def simulate(cfg, w, n: int, seed: int, model) -> dict:
    """One simulation; its report without the per-instance list, the flip log cut to 20, plus its
    wall and CPU seconds and flips per trigger."""
    from xllm.sim import Cluster, synthetic

    t0, c0 = time.monotonic(), time.process_time()
    cluster = Cluster(cfg, model)
    cluster.run(synthetic(w, n, seed))
    r = cluster.report()
    r["wall_s"], r["cpu_s"] = time.monotonic() - t0, time.process_time() - c0
    r.pop("instances")
    triggers: dict[str, int] = {}
    for flip in r["role_flip_log"]:
        key = f"{flip['from']}->{flip['to']} ({flip['trigger']})"
        triggers[key] = triggers.get(key, 0) + 1
    r["flips_by_trigger"] = triggers
    r["role_flip_log"] = r["role_flip_log"][:20]
    return r


def probe_line(name: str, rate: float, r: dict, n: int) -> str:
    return (f"[sim] {name} @ {rate:.1f} req/s x {n}: attainment {r['slo_attainment']:.1%}, goodput "
            f"{r['goodput']:.1f}, TTFT p99 {r['ttft_ms']['p99']:.0f} ms, TPOT p99 {r['tpot_ms']['p99']:.1f} ms, "
            f"flips {r['role_flips']}, {r['wall_s']:.0f} s wall / {r['cpu_s']:.0f} s CPU")


def record(rate: float, n: int, r: dict) -> dict:
    """What a probe or confirm run keeps in results.json."""
    keys = ("slo_attainment", "goodput", "ttft_ms", "tpot_ms", "role_flips", "flips_by_trigger",
            "request_throughput", "duration_s", "events", "wall_s", "cpu_s")
    return {"rate": rate, "requests": n, **{k: r[k] for k in keys if k in r}}


def mixes(args: argparse.Namespace, kind: str | None = None) -> list[tuple[float, float]]:
    """(mean prompt, mean output) tokens of each length mix of the workload (sampled)."""
    import random

    out = []
    for prompt, output in workload(args, 1.0, kind=kind).mixes():
        rng = random.Random(0)
        prompts = [prompt.draw(rng) for _ in range(2000)]
        outputs = [output.draw(rng) for _ in range(2000)]
        out.append((sum(prompts) / len(prompts), sum(outputs) / len(outputs)))
    return out


def mean_lengths(args: argparse.Namespace, kind: str | None = None) -> tuple[float, float]:
    """Mean prompt and output tokens over the workload's mixes (phases: equal time in each)."""
    ms = mixes(args, kind)
    return sum(p for p, _ in ms) / len(ms), sum(o for _, o in ms) / len(ms)


def default_slos(args: argparse.Namespace, model) -> None:
    """Objectives the profile's engine can meet unloaded, with headroom (unless given): TTFT 4x a mean
    prompt's prefill, TPOT 1.5x a decode step of 32 sequences of mean length (means over the PD
    workload's mixes)."""
    prompt, output = mean_lengths(args)
    if args.slo_ttft_ms is None:
        args.slo_ttft_ms = round(4 * model.prefill_seconds(int(prompt), token_budget=512) * 1e3)
    if args.slo_tpot_ms is None:
        args.slo_tpot_ms = round(1.5 * model.decode_seconds(32, int(32 * (prompt + output / 2))) * 1e3, 1)


def capacity_estimate(args: argparse.Namespace, model, instances: int, kind: str | None = None) -> float:
    """Requests/s the cluster might serve: instance-seconds per request from the step model (a mean
    prompt in 512-token chunks, a mean output in 32-sequence decode batches), of the costliest mix."""
    costs = [model.prefill_seconds(int(p), token_budget=512) + o * model.decode_seconds(32, int(32 * (p + o / 2))) / 32
             for p, o in mixes(args, kind)]
    return instances / max(costs)


def max_rate(name: str, run, start: float, target: float, probes: int) -> tuple[float, list[dict], float]:
    """The highest rate with attainment ≥ ``target``: double/halve from ``start`` until bracketed,
    then bisect (geometrically) ``probes`` times. ``run(rate) -> (report, requests)``. Returns the
    rate, the probes, and the last bracket's ratio hi/lo (2 when never bracketed)."""
    history: list[dict] = []

    def ok(rate: float) -> bool:
        r, n = run(rate)
        history.append(record(rate, n, r))
        print(probe_line(name, rate, r, n), flush=True)
        return r["slo_attainment"] >= target

    lo = hi = None
    rate = start
    for _ in range(12):
        if ok(rate):
            lo = rate
            if hi is not None:
                break
            rate *= 2
        else:
            hi = rate
            if lo is not None:
                break
            rate /= 2
    if lo is None:
        return 0.0, history, 2.0
    if hi is None:
        return lo, history, 2.0
    for _ in range(probes):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, history, hi / lo


def confirm(name: str, run, rate: float, step: float, target: float, retries: int) -> tuple[float, list[dict]]:
    """Run ``rate`` at full size (``run(rate) -> (report, requests)``); while it misses ``target``,
    retry at ``rate / step`` (at most ``retries`` times). Returns the confirmed rate (0: none met
    the target) and the runs."""
    runs: list[dict] = []
    for _ in range(retries + 1):
        if rate <= 0:
            break
        r, n = run(rate)
        runs.append(record(rate, n, r))
        print(probe_line(f"{name} confirm", rate, r, n), flush=True)
        if r["slo_attainment"] >= target:
            return rate, runs
        rate /= max(step, 1.05)
    return 0.0, runs


def pd_config(args: argparse.Namespace, model, name: str) -> dict:
    """One PD configuration: search its max rate, confirm it at full size."""
    pd_policy, routing, flips, overflow = PD_CONFIGS[name]
    half = args.instances // 2
    start = capacity_estimate(args, model, args.instances) * 0.7
    cfg = dataclasses.replace(base_config(args), prefill_instances=half, decode_instances=args.instances - half,
                              pd_policy=pd_policy, routing=routing, pd_overflow=overflow)
    if flips == "batch":
        cfg = dataclasses.replace(cfg, pd_max_flips=args.pd_batch, pd_max_in_progress=args.pd_batch)
    else:
        cfg = dataclasses.replace(cfg, pd_max_flips=flips)

    def sized(n: int):
        return lambda rate: (simulate(cfg, workload(args, rate), n, args.seed, model), n)

    found, history, step = max_rate(name, sized(args.search_requests), start, args.target, args.probes)
    best, confirms = confirm(name, sized(args.requests), found, step, args.target, args.confirm_retries)
    final = confirms[-1] if confirms else {}
    print(f"[sim] {name}: max rate {best:.1f} req/s within the SLO (confirmed on {args.requests} requests; "
          f"search found {found:.1f})", flush=True)
    return {"max_rate": best, "search_rate": found, "probes": history, "confirms": confirms,
            "slo_attainment": final.get("slo_attainment"), "role_flips": final.get("role_flips"),
            "flips_by_trigger": final.get("flips_by_trigger"), "pd_policy": pd_policy, "routing": routing,
            "prefill_overflow": overflow,
            "max_flips_per_decision": cfg.pd_max_flips, "max_in_progress": cfg.pd_max_in_progress}


def parallel(jobs: int, fn, items: list, done) -> None:
    """``done(item, fn(item))`` for every item, ``jobs`` processes at a time (1: in this process)."""
    if jobs <= 1 or len(items) <= 1:
        for item in items:
            done(item, fn(item))
        return
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {pool.submit(fn, item): item for item in items}
        for fut in concurrent.futures.as_completed(futures):
            done(futures[fut], fut.result())


def run_pd(args: argparse.Namespace, model, results: dict, save) -> None:
    import functools

    def done(name: str, result: dict) -> None:
        results["pd"][name] = result
        save()

    parallel(args.jobs, functools.partial(pd_config, args, model), args.configs, done)
    results["pd"] = {name: results["pd"][name] for name in args.configs if name in results["pd"]}


def run_colocation(args: argparse.Namespace, model, results: dict, save) -> None:
    start = capacity_estimate(args, model, args.instances, kind="gamma") * 0.7
    cfg = dataclasses.replace(base_config(args), instances=args.instances)
    if args.colo_max_rate:
        mixed, history = args.colo_max_rate, []
    else:
        mixed, history, _ = max_rate("mixed", lambda rate: (simulate(cfg, workload(args, rate, kind="gamma"),
                                                                     args.search_requests, args.seed, model),
                                                            args.search_requests),
                                     start, args.target, max(args.probes - 2, 1))
    results["colocation"]["mixed_max_rate"] = mixed
    results["colocation"]["probes"] = history
    if not mixed:
        results["colocation"]["error"] = "no rate met the SLO: nothing to co-locate with"
        print("[sim] co-location skipped: no rate met the SLO", flush=True)
        return
    online = mixed * args.colo_load
    results["colocation"]["online_rate"] = online
    import functools

    def done(name: str, r: dict) -> None:
        results["colocation"][name] = r
        print(f"[sim] co-location {name}: online attainment {r['slo_attainment']:.1%}, offline "
              f"{r['offline']['output_throughput']:.0f} tok/s, TPOT p99 {r['tpot_ms']['p99']:.1f} ms, "
              f"{r['wall_s']:.0f} s wall / {r['cpu_s']:.0f} s CPU", flush=True)
        save()

    parallel(args.jobs, functools.partial(colocation_run, args, model, online), list(COLO_RUNS), done)


COLO_RUNS = {"online-only": ("decode_first", 0.0), "decode_first": ("decode_first", 0.5),
             "colocation": ("colocation", 0.5)}


def colocation_run(args: argparse.Namespace, model, online: float, name: str) -> dict:
    """One co-location run: ``online`` req/s of online requests (``--requests`` of them) plus as many
    offline ones when the run has them."""
    policy, offline = COLO_RUNS[name]
    cfg = dataclasses.replace(base_config(args), instances=args.instances, batch_policy=policy)
    rate = online / (1 - offline)  # as many offline requests again as online ones
    n = int(args.requests / (1 - offline))
    r = simulate(cfg, workload(args, rate, offline, kind="gamma"), n, args.seed, model)
    r["rate"], r["requests_run"] = rate, n
    return r


# ---- report -------------------------------------------------------------------------------------------

def workload_line(meta: dict) -> str:
    if meta.get("workload", "gamma") == "phases":
        pf, dec = meta["phase_s"]
        return (f"Workload `phases`: Gamma arrivals (CV {meta['cv']}); {pf:g} s prefill-heavy periods (prompts "
                f"{meta['prefill_mix'][0]}, outputs {meta['prefill_mix'][1]}) alternate with {dec:g} s decode-heavy "
                f"ones (prompts {meta['decode_mix'][0]}, outputs {meta['decode_mix'][1]})")
    return (f"Workload `gamma`: Gamma arrivals (CV {meta['cv']}), prompts {meta['prompt_len']}, "
            f"outputs {meta['output_len']}")


def markdown(results: dict) -> str:
    meta = results["meta"]
    search = meta.get("search_requests", meta["requests"])
    lines = [f"# Simulated ablations ({meta['instances']} instances)", "",
             f"{workload_line(meta)}; {meta['prefix_groups']} shared prefixes of {meta['prefix_len']} tokens. "
             f"SLO: TTFT <= {meta['slo_ttft_ms']:g} ms, TPOT <= {meta['slo_tpot_ms']:g} ms, attainment >= "
             f"{meta['target']:.0%}. Max rates searched on {search} requests per probe and confirmed on "
             f"{meta['requests']}. Dynamic PD flip knobs: window {meta.get('pd_flip_window', 5.0):g} s, cluster "
             f"cool-down {meta.get('pd_cluster_cooldown', 10.0):g} s, instance cool-down "
             f"{meta.get('pd_flip_cooldown', 30.0):g} s, {meta.get('pd_max_in_progress', 1)} flip(s) under way at "
             f"most (`dynamic-one-flip`); `dynamic` and `dynamic-no-overflow` flip up to {meta.get('pd_batch')} "
             f"instances per decision ({meta.get('pd_batch')} under way at most); `-overflow` and `dynamic`: prefill "
             f"overflow onto decode instances (PDPlacement with the TTFT objective). Profile: {meta['profile']}"
             f"{' (PROVISIONAL: synthetic, not measured)' if meta['provisional'] else ''}.", ""]
    pd = results.get("pd", {})
    if pd:
        base = pd.get("minimal-load", {}).get("max_rate")
        static = pd.get("static", {}).get("max_rate")
        lines += ["## Dynamic PD vs static PD vs minimal-load", "",
                  "| config | PD policy | routing | prefill overflow | max rate within SLO (req/s, confirmed) | "
                  "vs minimal-load | vs static | attainment | role flips | search probes | confirm runs | "
                  "wall / CPU per confirm run (s) |",
                  "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, run in pd.items():
            confirms = run.get("confirms", [])
            att = run.get("slo_attainment")
            times = ", ".join(f"{c['wall_s']:.0f} / {c.get('cpu_s', 0):.0f}" for c in confirms) or "–"
            lines.append(f"| {name} | {run['pd_policy']} | {run['routing']} | "
                         f"{'on' if run.get('prefill_overflow') else 'off'} | {run['max_rate']:.1f} | "
                         f"{_ratio(run['max_rate'], base)} | {_ratio(run['max_rate'], static)} | "
                         f"{'–' if att is None else f'{att:.1%}'} | {run.get('role_flips') or 0} | "
                         f"{len(run['probes'])} | {len(confirms)} | {times} |")
        lines.append("")
    colo = results.get("colocation", {})
    if colo.get("online_rate"):
        lines += ["## Co-location", "", f"Mixed instances, workload `gamma` (prompts {meta['prompt_len']}, outputs "
                  f"{meta['output_len']}); max rate within the SLO {colo.get('mixed_max_rate', 0):.1f} req/s "
                  f"({f'search probes of {search} requests' if colo.get('probes') else 'given: --colo-max-rate'}); "
                  f"online rate {colo['online_rate']:.1f} req/s "
                  f"({meta['colo_load']:g}x) for {meta['requests']} online requests, plus as many offline requests "
                  "in the co-located runs.", "",
                  "| run | online SLO attainment | online TTFT p99 (ms) | online TPOT p99 (ms) | "
                  "offline output tok/s | offline completed | wall / CPU (s) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name in ("online-only", "decode_first", "colocation"):
            r = colo.get(name)
            if r:
                lines.append(f"| {name} | {r['slo_attainment']:.1%} | {r['ttft_ms']['p99']:.0f} | "
                             f"{r['tpot_ms']['p99']:.1f} | {r['offline']['output_throughput']:.0f} | "
                             f"{r['offline']['completed']} | {r['wall_s']:.0f} / {r.get('cpu_s', 0):.0f} |")
    return "\n".join(lines) + "\n"


def _ratio(x: float, base: float | None) -> str:
    return f"{x / base:.2f}x" if base else "–"


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, run in results.get("pd", {}).items():
        pts = sorted((p["rate"], p["slo_attainment"]) for p in run["probes"])
        line, = ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=f"{name} (max {run['max_rate']:.0f})")
        confirms = run.get("confirms", [])
        ax.plot([c["rate"] for c in confirms], [c["slo_attainment"] for c in confirms], "*", ms=12,
                color=line.get_color())
    ax.axhline(results["meta"]["target"], color="grey", ls="--", lw=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_title("Simulated PD ablation (dots: search probes, stars: confirm runs)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_png(results: dict, out: pathlib.Path) -> None:
    if results.get("pd"):
        plot(results, out / "sim.png")


def run(args: argparse.Namespace, output: Output) -> dict | int:
    if args.tiny:
        args.instances, args.requests, args.search_requests, args.probes, args.prefix_groups = 8, 400, 200, 2, 5
        args.phase_s = (15.0, 15.0)
    parts = [p for p in args.parts.split(",") if p]
    args.configs = [c for c in args.configs.split(",") if c] if isinstance(args.configs, str) else args.configs
    if args.pd_batch is None:
        args.pd_batch = max(args.instances // 10, 1)
    if (any(p not in PARTS for p in parts) or any(c not in PD_CONFIGS for c in args.configs) or args.instances < 2
            or min(args.requests, args.search_requests, args.pd_batch, args.jobs) < 1):
        print(f"python -m benchmarks sim: error: parts must be of {PARTS}, configs of {', '.join(PD_CONFIGS)}, "
              "instances >= 2, requests, search-requests, pd-batch and jobs >= 1", file=sys.stderr)
        return 2
    from xllm.sim.profile import DEFAULT_PROFILE, is_provisional, load_model

    model, _ = load_model(args.profile)
    default_slos(args, model)
    output.open()
    meta = {**flag_values(args), "timestamp": output.stamp, "argv": sys.argv,
            "profile": str(args.profile or DEFAULT_PROFILE), "provisional": is_provisional(args.profile)}
    results: dict = {"meta": meta, "pd": {}, "colocation": {}}

    def save() -> None:
        output.save(results)

    t0 = time.monotonic()
    if "pd" in parts:
        run_pd(args, model, results, save)
    if "colocation" in parts:
        run_colocation(args, model, results, save)
    meta["wall_s"] = time.monotonic() - t0
    return results


SCENARIO = Scenario("sim", "xllm-sim at 200 instances: dynamic/static PD, co-location", __doc__, add_arguments, run,
                    markdown, plot_png)
