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
in :data:`WORKLOADS`): vLLM's ``random`` dataset at fixed lengths, and a ShareGPT-like synthetic mix
(:mod:`benchmarks.sharegpt_synth`: lognormal prompt/response lengths, stdlib docstring text) fed
through ``--dataset-name sharegpt``, whose output lengths vLLM takes from the responses' token counts.

Results in ``--out`` (default ``benchmarks/results/serve-client-<timestamp>``): ``results.json``
(every metric of both systems, versions, every command line), ``summary.md`` (a table per workload:
metric, xLLM, vLLM, xLLM/vLLM), ``serve_client.png`` and ``serve_client_ttft_cdf.png``, ``raw/``
(vLLM's own result files), ``logs/`` (servers and client), ``sharegpt-*.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from benchmarks.report import add_output_args
from benchmarks.serve_client_report import length_check, markdown, parse_result, plot

HERE = pathlib.Path(__file__).resolve().parent
SYSTEMS = ("xllm", "vllm")
# What ``vllm bench serve`` runs (vllm/entrypoints/cli/benchmark/serve.py), minus the CLI's version lookup.
CLIENT_CODE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
               "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
               "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); "
               "main(p.parse_args(sys.argv[1:]))")
CLIENT_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Workload:
    """One client run: ``dataset`` "random" (fixed ``input_len``/``output_len``) or "sharegpt" (the
    synthetic file's lengths), ``num_prompts`` requests with at most ``concurrency`` in flight."""

    name: str
    dataset: str
    concurrency: int
    num_prompts: int
    input_len: int = 0
    output_len: int = 0
    description: str = ""


WORKLOADS = {w.name: w for w in (
    Workload("random-128-64-c16", "random", 16, 64, 128, 64,
             "random, 128 prompt / 64 output tokens, 16 concurrent, 64 prompts (the issue's reference point)"),
    Workload("random-512-128-c16", "random", 16, 64, 512, 128,
             "random, 512 prompt / 128 output tokens, 16 concurrent, 64 prompts"),
    Workload("random-1024-128-c16", "random", 16, 64, 1024, 128,
             "random, 1024 prompt / 128 output tokens, 16 concurrent, 64 prompts"),
    Workload("random-128-64-c64", "random", 64, 128, 128, 64,
             "random, 128 prompt / 64 output tokens, 64 concurrent, 128 prompts"),
    Workload("sharegpt-c16", "sharegpt", 16, 64,
             description="ShareGPT-like synthetic mix (lognormal lengths), 16 concurrent, 64 prompts"),
    Workload("sharegpt-c64", "sharegpt", 64, 128,
             description="ShareGPT-like synthetic mix (lognormal lengths), 64 concurrent, 128 prompts"),
    Workload("decode-32-256-c64", "random", 64, 128, 32, 256,
             "decode-heavy: random, 32 prompt / 256 output tokens, 64 concurrent, 128 prompts"),
)}


def scaled(w: Workload, spec: str | None) -> Workload:
    """``w`` with its prompt count set by ``--num-prompts``: ``N`` (every workload N prompts) or ``xF``
    (F times each default, at least 1); ``None`` keeps the default."""
    if spec is None:
        return w
    n = max(1, round(w.num_prompts * float(spec[1:]))) if spec.startswith("x") else int(spec)
    return Workload(w.name, w.dataset, w.concurrency, n, w.input_len, w.output_len, w.description)


def client_command(python: str, base_url: str, model_name: str, tokenizer: pathlib.Path, w: Workload,
                   seed: int, result_dir: pathlib.Path, result_file: str,
                   dataset_path: pathlib.Path | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """The client's command line for one workload against one server (``extra``: more client flags)."""
    cmd = [python, "-c", CLIENT_CODE, "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
           "--model", model_name, "--served-model-name", model_name, "--tokenizer", str(tokenizer),
           "--num-prompts", str(w.num_prompts), "--max-concurrency", str(w.concurrency),
           "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--ready-check-timeout-sec", "120", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_file,
           "--label", w.name]
    if w.dataset == "random":
        cmd += ["--dataset-name", "random", "--random-input-len", str(w.input_len),
                "--random-output-len", str(w.output_len), "--random-range-ratio", "0"]
    elif w.dataset == "sharegpt":
        if dataset_path is None:
            raise ValueError(f"{w.name}: a sharegpt workload needs its dataset file")
        cmd += ["--dataset-name", "sharegpt", "--dataset-path", str(dataset_path)]
    else:
        raise ValueError(f"{w.name}: unknown dataset {w.dataset!r}")
    return cmd + list(extra)


def client_env() -> dict[str, str]:
    """Offline and no-telemetry env vars for the client (vLLM's own runtime/cache dirs, no OMP binding:
    the client runs no model)."""
    from benchmarks.peers import vllm

    return {k: v for k, v in vllm.env(1).items() if not k.startswith(("VLLM_CPU_", "OMP_"))}


def expected_output_lens(w: Workload, sharegpt: list[dict] | None) -> list[int] | None:
    if w.dataset == "random":
        return [w.output_len] * w.num_prompts
    if sharegpt is not None and len(sharegpt) == w.num_prompts:
        return [e["output_tokens"] for e in sharegpt]
    return None


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


def warm_up(base_url: str, model_name: str, bank) -> None:
    """4 short requests (prompts of 300 and 32 tokens, 4 tokens out), as the other scenarios do."""
    import asyncio
    import random

    from benchmarks.client import EndpointProfile, RequestSpec, run_requests

    rng = random.Random(12345)
    specs = [RequestSpec(bank.prompt(n, rng).ids, "", 4) for n in (300, 32, 300, 32)]
    records, _ = asyncio.run(run_requests(base_url, model_name, specs, EndpointProfile()))
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[0]}")


def run_client(cmd: list[str], log: pathlib.Path, result: pathlib.Path) -> dict:
    """Run one client command (output to ``log``) and return the JSON it saved."""
    log.parent.mkdir(parents=True, exist_ok=True)
    result.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **client_env()},
                             timeout=CLIENT_TIMEOUT_S, cwd=str(result.parent))
    if res.returncode != 0 or not result.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"client exited {res.returncode}; log {log}:\n{tail}")
    return json.loads(result.read_text())


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


def run_workloads(label: str, python: str, base_url: str, model_dir: pathlib.Path, workloads: list[Workload],
                  seed: int, out: pathlib.Path, datasets: dict[str, pathlib.Path],
                  record: Callable[[Workload, list[str], dict, str, float], None],
                  fail: Callable[[Workload, str], None], extra: tuple[str, ...] = ()) -> None:
    """Run vLLM's client (``python``: its venv's interpreter) once per workload against the server at
    ``base_url``, one after the other. Each result goes to ``record(workload, command, raw result,
    raw file relative to out, elapsed seconds)``; a client that fails goes to ``fail(workload,
    message)`` and the next workload runs. Files: ``out/raw/{label}-{workload}.json`` and
    ``out/logs/client-{label}-{workload}.log``; ``extra``: more client flags."""
    for w in workloads:
        raw_file = f"{label}-{w.name}.json"
        cmd = client_command(python, base_url, model_dir.name, model_dir, w, seed, out / "raw", raw_file,
                             datasets.get(w.name), extra=extra)
        t0 = time.monotonic()
        try:
            raw = run_client(cmd, out / "logs" / f"client-{label}-{w.name}.log", out / "raw" / raw_file)
        except Exception as exc:  # record it and go on with the next workload
            fail(w, f"{type(exc).__name__}: {exc}"[:1500])
            continue
        record(w, cmd, raw, f"raw/{raw_file}", time.monotonic() - t0)


def make_sharegpt_files(workloads: list[Workload], bank, out: pathlib.Path,
                        seed: int) -> tuple[dict[str, pathlib.Path], dict[str, list[dict]], dict]:
    """One synthetic ShareGPT file per sharegpt workload, exactly ``num_prompts`` entries (vLLM shuffles
    them with ``--seed`` and takes them all), the same seed for every workload (so a smaller file is the
    start of a larger one's lengths)."""
    from benchmarks import sharegpt_synth as sg

    paths, entries, lengths = {}, {}, {}
    for w in workloads:
        if w.dataset != "sharegpt":
            continue
        conv = sg.conversations(bank, w.num_prompts, seed=seed)
        problems = sg.validate(conv)
        if problems:
            raise RuntimeError(f"synthetic ShareGPT file is malformed: {problems[:3]}")
        paths[w.name] = sg.write(out / f"sharegpt-{w.name}.json", conv)
        entries[w.name] = conv
        lengths[w.name] = sg.length_summary(conv)
    meta = {"prompt_spec": sg.PROMPT_LENGTHS.describe(), "output_spec": sg.OUTPUT_LENGTHS.describe(),
            "lengths": lengths} if paths else {}
    return paths, entries, meta


def write_report(out: pathlib.Path, plots: bool = True) -> str:
    """summary.md (and the plots) from ``out/results.json``; returns the summary."""
    results = json.loads((out / "results.json").read_text())
    summary = markdown(results)
    (out / "summary.md").write_text(summary)
    if plots:
        plot(results, out)
    return summary


# ---- command line -------------------------------------------------------------------------------

def _names(choices, what: str):
    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in names if s not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad}; choose from {', '.join(choices)}")
        return names
    return parse


def _num_prompts(text: str) -> str:
    try:
        ok = float(text[1:]) > 0 if text.startswith("x") else int(text) >= 1
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected N >= 1 or xF with F > 0, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks serve-client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", type=_names(SYSTEMS, "system(s)"), default=list(SYSTEMS),
                   help="comma-separated systems; their servers run side by side and take turns per workload, "
                        "in this order first (default: xllm,vllm)")
    p.add_argument("--passes", type=int, default=1, choices=range(1, 11), metavar="N",
                   help="passes over the workloads, the systems' order reversed each pass; the report adds the "
                        "median of the per-pass ratios (1)")
    p.add_argument("--workloads", type=_names(tuple(WORKLOADS), "workload(s)"), default=list(WORKLOADS),
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report is not None:
        print(write_report(args.report, plots=not args.no_plots))
        return 0
    from benchmarks.machine import cpu_busy_fraction, git_commit, machine_info
    from benchmarks.peers import vllm, xllm
    from benchmarks.prompts import PromptBank

    workloads = [scaled(WORKLOADS[n], args.num_prompts) for n in args.workloads]
    model_dir = xllm.model_dir(args.model).resolve()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = (args.out or HERE / "results" / f"serve-client-{stamp}").resolve()
    (out / "raw").mkdir(parents=True, exist_ok=True)
    # the client always runs from the vLLM venv, whichever systems are measured
    print("[serve-client] vLLM venv (installs vllm-cpu the first time, a few minutes) ...", flush=True)
    vllm.install()
    bank = PromptBank(model_dir)
    datasets, sharegpt, sharegpt_meta = make_sharegpt_files(workloads, bank, out, args.seed)
    versions = {"vllm": vllm.versions()}
    if "xllm" in args.systems:
        versions["xllm"] = xllm.versions()
    results: dict = {
        "meta": {**{k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
                 "timestamp": stamp, "argv": sys.argv, "model": model_dir.name, "model_dir": str(model_dir),
                 "commit": git_commit(str(HERE.parent)), "machine": machine_info(), "versions": versions,
                 "client_code": CLIENT_CODE, "client_env": client_env(), "sharegpt": sharegpt_meta,
                 "cpu_busy_before": cpu_busy_fraction()},
        "workloads": [asdict(w) for w in workloads], "runs": {}, "servers": {}, "errors": {},
    }
    if (results["meta"]["cpu_busy_before"] or 0) > 0.10:
        print(f"[serve-client] WARNING: the CPUs are {results['meta']['cpu_busy_before']:.0%} busy with other work; "
              "figures will not be comparable", flush=True)

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1))

    print(f"[serve-client] systems {args.systems}, workloads {[w.name for w in workloads]}; model "
          f"{model_dir.name} {args.dtype}; results in {out}", flush=True)
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:  # the servers stop (by PID) when the runs are done
        servers = start_servers(args, model_dir, out, bank, results, stack, save)
        run_turns(args, servers, model_dir, out, workloads, datasets, sharegpt, results, save)
    results["meta"]["elapsed_s"] = time.monotonic() - t0
    results["meta"]["cpu_busy_after"] = cpu_busy_fraction()
    save()
    print(write_report(out, plots=not args.no_plots))
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
