"""The simulator against this machine: one trace replayed live on ``xllm serve --instances 2`` and in
``xllm-sim`` with the same policies, and the error of the simulation on throughput, TTFT p50/p99
and TPOT p50 (Vidur reports under 9 %).

    python -m benchmarks sim-validate                         # 60 requests, Poisson 0.4 req/s, 2 instances
    python -m benchmarks sim-validate --profile prof.json     # with a profile measured before
    python -m benchmarks sim-validate --sim-only --profile prof.json   # the simulated half only

The trace: ``--requests`` requests at Poisson arrivals of ``--rate`` req/s, prompt and output lengths
drawn from ``--prompt-len`` / ``--output-len`` (xllm-sim's syntax), prompts cut from the benchmark
corpus at exactly those lengths, every request generating exactly its output length (greedy,
``ignore_eos``). It is written to ``trace.csv`` (``arrival,prompt_len,output_len``: ``xllm-sim run
--trace`` replays it). Live: ``xllm serve --instances N --threads 1`` (one thread per engine
process, as the profile must be measured), warmed up, then the trace, streamed, recorded per request.
Simulated: the same requests on N mixed instances with the same routing policy, batch policy, token
budget, ``--max-num-seqs`` and KV capacity (``--kv-cache-memory`` GiB of SmolLM2 bf16), step times
from the profile: ``--profile``, which must have been measured on an engine like the live ones (dtype,
float weights, 1 thread: a Q4_1 profile, ``xllm profile``'s default on the bundled GGUF, predicts the
bf16 engines' decode steps at 0.6x), or else one measured first with ``xllm profile`` on the live
engines' model and flags (about a minute; ``profile.json`` in ``--out``). ``--sim-only`` without
``--profile``: xllm-sim's shipped profile. Three simulations: the profile as measured; scaled by the
measured over predicted step time of the live engines over the trace (the increments of their
``xllm:step_time_measured_seconds`` and ``..._predicted_seconds``: the machine's speed during the run,
which drifts by up to ~20 % over minutes here, and the contention of two engines, the gateway and the
client on its cores); and that plus lognormal step noise as wide as the live steps' scatter around
their corrected predictions. Results: ``results.json`` and ``summary.md`` in ``--out`` (default
``benchmarks/results/sim-validate-<timestamp>``).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import time

from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario, flag_values

FIGURES = (("output throughput (tok/s)", ("output_throughput",)), ("TTFT p50 (ms)", ("ttft_ms", "p50")),
           ("TTFT p99 (ms)", ("ttft_ms", "p99")), ("TPOT p50 (ms)", ("tpot_ms", "p50")),
           ("TPOT p99 (ms)", ("tpot_ms", "p99")), ("E2E p50 (ms)", ("e2e_ms", "p50")))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=60, help="requests in the trace (60)")
    p.add_argument("--rate", type=float, default=0.4, help="Poisson arrival rate, req/s (0.4)")
    p.add_argument("--prompt-len", default="uniform:64:1024", help="prompt lengths (uniform:64:1024)")
    p.add_argument("--output-len", default="uniform:16:256", help="output lengths (uniform:16:256)")
    p.add_argument("--instances", type=int, default=2, help="engine processes / simulated instances (2)")
    p.add_argument("--routing", default="kv_aware", help="the gateway's routing policy, both sides (kv_aware)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="per instance, both sides (32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget, both sides (512)")
    p.add_argument("--kv-cache-memory", type=float, default=1.0, metavar="GIB", help="KV per instance (1.0)")
    p.add_argument("--profile", type=pathlib.Path, default=None,
                   help="the step-time profile of one engine of the cluster (`xllm profile --threads 1 --model "
                        "DIR` on the live engines' model and dtype); default: measure one first (with "
                        "--sim-only: xllm-sim's shipped one)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled SmolLM2)")
    p.add_argument("--sim-only", action="store_true", help="skip the live run (needs no model or server)")
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p, "sim-validate", report=False)


def trace(args: argparse.Namespace) -> list:
    from xllm.sim import Workload, synthetic

    return list(synthetic(Workload(rate=args.rate, prompt=args.prompt_len, output=args.output_len),
                          args.requests, args.seed))


def kv_blocks(args: argparse.Namespace) -> int:
    from xllm.sim.config import SMOLLM2_BLOCK_SIZE, SMOLLM2_KV_BYTES_PER_TOKEN

    return int(args.kv_cache_memory * (1 << 30)) // (SMOLLM2_KV_BYTES_PER_TOKEN * SMOLLM2_BLOCK_SIZE)


def simulated(args: argparse.Namespace, specs: list, scale: float = 1.0, noise: float = 0.0) -> dict:
    """The trace in the simulator, as the live cluster is configured; ``scale`` multiplies every step
    time of the profile's model (an online correction factor); ``noise``: the simulator's
    ``step_noise``, the scatter of the live steps around the corrected model."""
    from xllm.sched.latency import StepTimeModel
    from xllm.sim import Cluster, SimConfig, load_model

    model, _ = load_model(args.profile)
    model = StepTimeModel(tuple(scale * c for c in model.coefficients))
    cfg = SimConfig(instances=args.instances, routing=args.routing, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, kv_blocks=kv_blocks(args), step_noise=noise)
    cluster = Cluster(cfg, model)
    cluster.run(specs)
    r = cluster.report()
    r["records"] = [q.to_dict() for q in cluster.requests]
    return r


def measure_profile(args: argparse.Namespace, out: pathlib.Path) -> pathlib.Path:
    """``xllm profile`` on the live engines' model, dtype, budget and batch limit, 1 thread: ``out/profile.json``."""
    import subprocess

    from benchmarks.peers import xllm

    path = out / "profile.json"
    cmd = [sys.executable, "-m", "xllm.gateway", "profile", "--model", str(xllm.model_dir(args.model)),
           "--dtype", args.dtype, "--threads", "1", "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-num-seqs", str(args.max_num_seqs), "--output", str(path), "--no-progress", "--log-level", "warning"]
    print("measuring the engines' profile:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return path


def check_profile(path: pathlib.Path, dtype: str) -> None:
    """Refuse a profile measured on another kind of engine than the live ones (float ``dtype`` weights,
    1 thread): the simulation would be off by step shape, not by a factor."""
    from xllm.sched.latency import PerfProfile

    differences = PerfProfile.load(path).mismatches(dtype, "", 1)
    if differences:
        raise SystemExit(f"sim-validate: --profile {path} was measured on another engine than the live ones "
                         f"({', '.join(differences)}); measure one with `xllm profile --threads 1 --model DIR "
                         f"--dtype {dtype}`, or leave --profile out to have one measured")


def live(args: argparse.Namespace, specs: list, out: pathlib.Path) -> dict:
    """The trace against ``xllm serve --instances N``: its serving summary and records."""
    import asyncio
    import random

    from benchmarks.client import EndpointProfile, RequestSpec, run_requests
    from benchmarks.peers import xllm
    from benchmarks.prompts import PromptBank
    from benchmarks.stats import serving_summary

    model_dir = xllm.model_dir(args.model)
    bank = PromptBank(model_dir)
    rng = random.Random(args.seed)
    requests = [RequestSpec(bank.prompt(s.prompt_len, rng).ids, "", s.output_len, s.arrival) for s in specs]
    warmup = [RequestSpec(bank.prompt(n, rng).ids, "", 4) for n in (300, 32, 300, 32)]
    extra = ["--instances", str(args.instances), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--kv-cache-memory", str(args.kv_cache_memory), "--routing", args.routing]
    if args.profile is not None:  # the engines predict from the same profile: their online correction
        extra += ["--profile", str(args.profile)]  # factor is then measured over profile-predicted step time
    server = xllm.server(model_dir, args.dtype, 1, out / "logs", max_num_seqs=args.max_num_seqs, extra_args=extra)
    profile = EndpointProfile()
    with server:
        xllm.wait_instances(server.base_url, args.instances)
        import httpx
        model = httpx.get(server.base_url + "/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
        asyncio.run(run_requests(server.base_url, model, warmup, profile))
        before = httpx.get(server.base_url + "/metrics", timeout=10, trust_env=False).text
        records, duration = asyncio.run(run_requests(server.base_url, model, requests, profile, desc="live"))
        metrics = httpx.get(server.base_url + "/metrics", timeout=10, trust_env=False).text
    summary = serving_summary(records, duration)
    summary["records"] = [r.to_dict() for r in records]
    summary["correction_factors"] = per_instance(metrics, "xllm:step_time_correction_factor")
    summary["prediction_errors"] = per_instance(metrics, "xllm:step_time_prediction_error_recent")
    summary["step_seconds"] = step_seconds(before, metrics)
    return summary


def step_seconds(before: str, after: str) -> dict[str, dict[str, float]]:
    """Per instance, the measured and predicted seconds of its steps between two scrapes of /metrics
    (``xllm:step_time_measured_seconds`` / ``..._predicted_seconds``)."""
    out: dict[str, dict[str, float]] = {}
    for key, name in (("measured", "xllm:step_time_measured_seconds_total"),
                      ("predicted", "xllm:step_time_predicted_seconds_total")):
        start = per_instance(before, name)
        for instance, value in per_instance(after, name).items():
            out.setdefault(instance, {})[key] = value - start.get(instance, 0.0)
    return out


def run_ratio(seconds: dict[str, dict[str, float]]) -> float | None:
    """Measured over predicted step time over the trace, all instances' steps together (None: no
    prediction made)."""
    measured = sum(v.get("measured", 0.0) for v in seconds.values())
    predicted = sum(v.get("predicted", 0.0) for v in seconds.values())
    return measured / predicted if predicted > 0 else None


def per_instance(metrics_text: str, name: str) -> dict[str, float]:
    """A per-instance series of the gateway's /metrics (``name``, e.g. ``xllm:step_time_correction_factor``)
    by instance id."""
    from benchmarks.metrics import parse

    samples = parse(metrics_text).get(name, [])
    return {labels.get("instance", ""): value for labels, value in samples}


def noise_sigma(mean_relative_error: float) -> float:
    """The lognormal log-deviation whose mean relative deviation from 1 is ``mean_relative_error``
    (E|X − 1| ≈ σ·√(2/π) for a small σ): the simulator's ``step_noise`` for steps that scatter that
    much around their prediction."""
    return mean_relative_error * math.sqrt(math.pi / 2)


def _get(d: dict, path: tuple[str, ...]) -> float | None:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d if isinstance(d, (int, float)) and not math.isnan(d) else None


def compare(live_summary: dict, sim_report: dict) -> dict:
    """Per figure: live, simulated and the simulation's relative error (sim / live − 1)."""
    out = {}
    for name, path in FIGURES:
        a, b = _get(live_summary, path), _get(sim_report, path)
        out[name] = {"live": a, "sim": b, "error": (b / a - 1) if a and b is not None else None}
    return out


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"# Simulator validation: {meta['requests']} requests, Poisson {meta['rate']} req/s, "
             f"{meta['instances']} instances", "",
             f"Prompts {meta['prompt_len']}, outputs {meta['output_len']}; routing {meta['routing']}, max-num-seqs "
             f"{meta['max_num_seqs']}, budget {meta['max_num_batched_tokens']}, KV {meta['kv_cache_memory']} GiB. "
             f"Profile: {meta['profile']}{' (PROVISIONAL: synthetic)' if meta['provisional'] else ''}.", "",
             "| figure | live | simulated | error |", "| --- | ---: | ---: | ---: |"]
    def f(x):
        return "–" if x is None else f"{x:.1f}"

    def err(row):
        return "–" if row["error"] is None else f"{row['error']:+.1%}"

    corrected = results.get("comparison_corrected") or {}
    noisy = results.get("comparison_noisy") or {}
    if corrected:
        lines[-2:] = [f"Simulated with the profile as measured, and with it scaled by the live engines' "
                      f"measured over predicted step time over the trace ({meta['correction_factor']:.2f})"
                      + (f", and with that plus step times scattered as the live steps were around their "
                         f"corrected predictions (`--step-noise {meta['step_noise']:.3f}`)." if noisy else "."), "",
                      "| figure | live | simulated | error | simulated, corrected | error |"
                      + (" corrected + noise | error |" if noisy else ""),
                      "| --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if noisy else "")]
    for name, row in results["comparison"].items():
        line = f"| {name} | {f(row['live'])} | {f(row['sim'])} | {err(row)} |"
        if corrected:
            c = corrected[name]
            line += f" {f(c['sim'])} | {err(c)} |"
        if noisy:
            c = noisy[name]
            line += f" {f(c['sim'])} | {err(c)} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, output: Output) -> dict:
    from xllm.sim.profile import DEFAULT_PROFILE, is_provisional

    out = output.open()
    specs = trace(args)
    (out / "trace.csv").write_text("arrival,prompt_len,output_len\n" + "".join(
        f"{s.arrival:.6f},{s.prompt_len},{s.output_len}\n" for s in specs))
    if args.profile is not None:
        check_profile(args.profile, args.dtype)
    elif not args.sim_only:
        args.profile = measure_profile(args, out)
    meta = {**flag_values(args), "timestamp": output.stamp, "argv": sys.argv,
            "profile": str(args.profile or DEFAULT_PROFILE), "provisional": is_provisional(args.profile)}
    t0 = time.monotonic()
    sim = simulated(args, specs)
    meta["sim_wall_s"] = time.monotonic() - t0
    results = {"meta": meta, "sim": sim, "live": None, "comparison": {}}
    if not args.sim_only:
        from benchmarks.machine import cpu_busy_fraction
        meta["cpu_busy_before"] = cpu_busy_fraction()
        results["live"] = live(args, specs, out)
        meta["cpu_busy_after"] = cpu_busy_fraction()
        results["comparison"] = compare(results["live"], sim)
        ratio = run_ratio(results["live"]["step_seconds"])
        if ratio is not None:  # the profile scaled to the live engines' steps over the trace
            meta["correction_factor"] = ratio
            results["sim_corrected"] = simulated(args, specs, meta["correction_factor"])
            results["comparison_corrected"] = compare(results["live"], results["sim_corrected"])
            errors = results["live"]["prediction_errors"]
            if errors:  # and the live steps' scatter around the corrected model
                meta["step_noise"] = noise_sigma(statistics.fmean(errors.values()))
                results["sim_noisy"] = simulated(args, specs, meta["correction_factor"], meta["step_noise"])
                results["comparison_noisy"] = compare(results["live"], results["sim_noisy"])
    else:
        results["comparison"] = compare({}, sim)
    return results


SCENARIO = Scenario("sim-validate", "one trace live (xllm serve --instances 2) and simulated", __doc__, add_arguments,
                    run, markdown)
