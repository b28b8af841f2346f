"""``python -m benchmarks`` (what ``nox -s bench -- ...`` runs).

    python -m benchmarks all                          # roofline, batch-1 (bf16+fp32), 16/64 concurrent, rate sweep
    python -m benchmarks batch1 --systems xllm,llamacpp --dtype float32
    python -m benchmarks online --arrival gamma --cv 3 --rate 2
    python -m benchmarks online --trace trace.csv --trace-speedup 2
    python -m benchmarks install vllm llamacpp hf     # only build the peers' venvs
    python -m benchmarks report benchmarks/results/20261122-101500   # rebuild summary.md + plots
    python -m benchmarks routing                      # round robin vs least load vs KV-aware routing, 2 instances
    python -m benchmarks pd                           # 1 prefill + 1 decode vs 2 mixed instances, per KV transport
    python -m benchmarks reliability                  # faults: kill -9, SIGTERM, etcd, gateway, floods, bad clients
    python -m benchmarks moves                        # a draining engine's requests: KV migration vs recompute
    python -m benchmarks gemm                         # GEMM kernels per shape and row count: ours vs oneDNN
    python -m benchmarks gemm_quant                   # quantized-weight GEMV/GEMM per format: GB/s, accuracy
    python -m benchmarks steps                        # one engine step by shape: eager vs fused native, by part
    python -m benchmarks budget                       # the token budget against goodput under a TTFT + TPOT SLO
    python -m benchmarks serve-client                 # xLLM and vLLM driven by vLLM's own benchmark client
    python -m benchmarks sim                          # xllm-sim at 200 instances: dynamic/static PD, co-location
    python -m benchmarks sim-validate                 # one trace live (xllm serve --instances 2) and simulated
    python -m benchmarks elastic                      # online/offline co-location on/off, static vs dynamic PD
    python -m benchmarks predictor                    # step/TTFT/TPOT predictions vs a held-out live run
    python -m benchmarks structured                   # TPOT with and without a JSON schema, xLLM vs vLLM-CPU
    python -m benchmarks spec                         # speculative decoding per proposer, xLLM vs vLLM-CPU
    python -m benchmarks quant                        # quantized weights per format: decode, RSS, perplexity
    python -m benchmarks hugepages                    # engine steps, weights on 2 MiB vs 4 KiB pages
    python -m benchmarks recsys                       # beam search over a 10^6-item catalogue, xLLM vs vLLM-CPU vs HF
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import shlex
import sys

from benchmarks.scenarios import ALL, ALL_SYSTEMS, SCENARIOS, Settings

HERE = pathlib.Path(__file__).resolve().parent
PEERS = ("vllm", "llamacpp", "hf")
# scenarios with their own command line: name -> module with ``main(argv) -> int``
SUBCOMMANDS = {
    "routing": "benchmarks.routing",
    "pd": "benchmarks.pd",
    "reliability": "benchmarks.reliability",
    "moves": "benchmarks.moves",
    "gemm": "benchmarks.gemm",
    "gemm_quant": "benchmarks.gemm_quant",
    "steps": "benchmarks.steps",
    "budget": "benchmarks.budget",
    "serve-client": "benchmarks.serve_client",
    "elastic": "benchmarks.elastic",
    "predictor": "benchmarks.predictor",
    "structured": "benchmarks.structured",
    "spec": "benchmarks.spec",
    "quant": "benchmarks.quant",
    "hugepages": "benchmarks.hugepages",
    "recsys": "benchmarks.recsys",
    "sim": "benchmarks.sim",
    "sim-validate": "benchmarks.sim_validate",
    "kv_tiers": "benchmarks.kv_tiers",
}


def _systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in ALL_SYSTEMS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown system(s) {bad}; choose from {', '.join(ALL_SYSTEMS)}")
    return names


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return vals


def _opt_float(text: str) -> float | None:
    return None if text.lower() in ("none", "off", "") else float(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenarios", nargs="+", choices=[*SCENARIOS, "all"], metavar="SCENARIO",
                   help=f"one or more of: {', '.join(SCENARIOS)}, all (= {' '.join(ALL)})")
    g = p.add_argument_group("what and where")
    g.add_argument("--systems", type=_systems, default=list(ALL_SYSTEMS),
                   help=f"comma-separated systems (default all: {','.join(ALL_SYSTEMS)})")
    g.add_argument("--skip", type=_systems, default=[], help="systems to leave out")
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
    return p


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


def cmd_run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from benchmarks.machine import cpu_busy_fraction, git_commit, machine_info
    from benchmarks.report import write_report
    from benchmarks.scenarios import run_all

    scenarios = list(ALL) if "all" in args.scenarios else list(dict.fromkeys(args.scenarios))
    from benchmarks.peers.xllm import model_dir as xllm_model_dir

    model_dir = xllm_model_dir(args.model, progress=not args.no_progress)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or HERE / "results" / stamp
    try:
        settings = _settings(args, model_dir.resolve(), out)
    except ValueError as exc:
        print(f"python -m benchmarks: error: {exc}", file=sys.stderr)
        return 2
    meta = {"timestamp": stamp, "argv": sys.argv, "scenarios": scenarios, "model": model_dir.name,
            "model_dir": str(model_dir), "threads": args.threads, "machine": machine_info(),
            "commit": git_commit(str(HERE.parent)), "settings": settings.to_dict()}
    print(f"[bench] scenarios {', '.join(scenarios)}; systems {', '.join(settings.systems)}; results in {out}",
          flush=True)
    meta["cpu_busy_before"] = _busy_check(cpu_busy_fraction)
    results = run_all(scenarios, settings, meta)
    results["meta"]["cpu_busy_after"] = _busy_check(cpu_busy_fraction)
    results["meta"]["versions"] = collect_versions(settings.systems)
    summary = write_report(results, out, plots=not args.no_plots)
    print(summary.read_text())
    print(f"[bench] results: {out / 'results.json'}\n[bench] summary: {summary}", flush=True)
    return 1 if results.get("errors") else 0


def _busy_check(measure) -> float | None:
    busy = measure()
    if busy is not None and busy > 0.1:
        print(f"[bench] WARNING: {busy:.0%} of the CPUs were busy with other work while the harness was idle; "
              "figures from a shared machine are not comparable (2-thread runs slow down many times over when "
              "another process takes a core)", flush=True)
    return busy


def cmd_install(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks install",
                                description="Create the peers' venvs under $XLLM_CACHE_DIR/bench/venvs "
                                            "(and the GGUFs).")
    p.add_argument("peers", nargs="*", choices=PEERS, default=list(PEERS))
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)
    from benchmarks.peers import hf, llamacpp, vllm

    for name in args.peers or PEERS:
        print(f"[bench] installing {name} ...", flush=True)
        {"vllm": vllm, "llamacpp": llamacpp, "hf": hf}[name].install()
        if name == "llamacpp":
            from xllm.models import resolve_model

            model_dir = pathlib.Path(args.model) if args.model else resolve_model()
            for dt in ("bfloat16", "float32"):
                print(f"[bench] GGUF {dt}: {llamacpp.gguf_for(model_dir.resolve(), dt)}", flush=True)
    return 0


def cmd_report(argv: list[str]) -> int:
    import json

    p = argparse.ArgumentParser(prog="python -m benchmarks report", description="Rebuild summary.md and plots.")
    p.add_argument("dir", type=pathlib.Path)
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    from benchmarks.report import write_report

    results = json.loads((args.dir / "results.json").read_text())
    print(write_report(results, args.dir, plots=not args.no_plots).read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "install":
        return cmd_install(argv[1:])
    if argv and argv[0] == "report":
        return cmd_report(argv[1:])
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    return cmd_run(argv)
