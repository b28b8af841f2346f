"""Tensor parallelism on the same cores, side by side: xLLM TP=1 against TP=2 (the native shared-memory
all-reduce and gloo's), and vLLM-CPU TP=1 and TP=2, driven by vLLM's own benchmark client.

    python -m benchmarks parallel                                   # both models, every system, c=1,16,64
    python -m benchmarks parallel --models smollm2 --systems xllm-tp1,xllm-tp2-shm --concurrency 1
    python -m benchmarks parallel --report benchmarks/results/parallel-20261206-230000

Models (``--models``): ``smollm2``, the bundled SmolLM2-135M (9 query / 3 KV heads: its heads do not
divide by 2, so xLLM splits them unevenly, 6+3 / 2+1, and vLLM refuses TP=2 on it), and ``qwen05``,
random weights of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 / 2 heads, intermediate 4864, tied
embeddings) with SmolLM2's tokenizer and so its 49,152-token vocabulary instead of 151,936 (the
tokenizer must cover every id the model can emit), made once and cached under ``XLLM_CACHE_DIR``.

Systems (``--systems``): ``xllm-tp1`` (one rank, ``--threads`` threads), ``xllm-tp2-shm`` and
``xllm-tp2-gloo`` (two ranks, ``--threads`` / 2 threads each, all-reduce through the native shared
memory or gloo; ``--tp-overlap auto``), ``xllm-tp2-gloo-nooverlap`` (gloo, ``--tp-overlap off``),
``vllm-tp1`` and ``vllm-tp2`` (vLLM-CPU eager, ``--tensor-parallel-size``, its OpenMP threads bound to the
same cores; vLLM only on models whose heads divide). Every server of a model is
started one after the other, warmed up, and left running side by side (idle servers take no CPU); per
concurrency every system runs the same client workload (``--input-len`` random prompt tokens,
``--output-len`` output tokens, ``--ignore-eos``), the systems' order reversed from one concurrency to the
next. Before the servers, the collective itself: the all-reduce of a ``[rows, hidden]`` bf16 tensor
between two processes, native shared memory against gloo (:func:`xllm.core.parallel.bench.allreduce_latencies`),
from which the report estimates the all-reduce's share of a decode step (2 all-reduces per layer); and the
step split (:mod:`benchmarks.parallel_steps`): two ranks of the first model in this process and a peer, the
eager step of a few shapes plain and overlapped (two micro-batches, one's all-reduce in flight while the
other computes), its time and the all-reduce's share of it, over shm and gloo (``--step-iters``).

Results in ``--out`` (default ``benchmarks/results/parallel-<timestamp>``): ``results.json``,
``summary.md`` (per model and concurrency: output tok/s, TTFT and TPOT p50/p99, each system's ratio to
xLLM TP=1; the all-reduce table; the step split), ``parallel.png``, ``parallel-steps.png``, ``raw/`` and
``logs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import shutil
import time

from benchmarks.report import add_output_args, fmt
from benchmarks.scenario import Output, Scenario, attempt
from benchmarks.serve_client_report import parse_result
from benchmarks.vllm_client import CLIENT_CODE, Workload, run_workloads, warm_up
from xllm.common.argtypes import int_list, name_list

SYSTEMS = ("xllm-tp1", "xllm-tp2-shm", "xllm-tp2-gloo", "xllm-tp2-gloo-nooverlap", "vllm-tp1", "vllm-tp2")
MODELS = ("smollm2", "qwen05")
# Qwen2.5-0.5B's config (HF Qwen/Qwen2.5-0.5B), but SmolLM2's vocabulary (see the module docstring)
QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=True, vocab_size=49152)
PROMPTS = {1: 8, 16: 32, 64: 64}  # client prompts per concurrency (default)


def qwen05_dir(smollm2: pathlib.Path) -> pathlib.Path:
    """The random Qwen2.5-0.5B-shaped model in bf16 (made once, cached under ``XLLM_CACHE_DIR``)."""
    from xllm.common.paths import cache_dir

    path = cache_dir() / "bench-models" / "qwen2.5-0.5b-shape-random"
    if (path / "config.json").is_file():
        return path
    import torch
    import transformers

    from xllm.testing.models import TOKENIZER_FILES, save_random_hf_model

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cfg = transformers.Qwen2Config(**QWEN05, torch_dtype=torch.bfloat16)
    print("[parallel] making the random Qwen2.5-0.5B-shaped model (once) ...", flush=True)
    model = save_random_hf_model(tmp, cfg, seed=0, std=0.02)
    model.to(torch.bfloat16).save_pretrained(tmp)  # one bf16 file: the float32 shards' index must go with them
    (tmp / "model.safetensors.index.json").unlink(missing_ok=True)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).is_file():
            shutil.copy(smollm2 / name, tmp / name)
    tmp.rename(path)
    return path


def heads_divide(model_dir: pathlib.Path, n: int) -> bool:
    cfg = json.loads((model_dir / "config.json").read_text())
    return cfg["num_attention_heads"] % n == 0 and cfg.get("num_key_value_heads", 1) % n == 0


def start(system: str, model_dir: pathlib.Path, args: argparse.Namespace, logs: pathlib.Path):
    """The server of ``system`` on ``model_dir`` (a :class:`~benchmarks.peers.venv.ServerProcess`, not started)."""
    from benchmarks.peers import vllm, xllm

    tp = 2 if "tp2" in system else 1
    if system.startswith("xllm"):
        extra = ["--served-model-name", model_dir.name]
        if tp > 1:
            comm = system.split("-")[2]
            extra += ["--tensor-parallel-size", str(tp), "--tp-comm", comm]
            if system.endswith("-nooverlap"):
                extra += ["--tp-overlap", "off"]
        server = xllm.server(model_dir, args.dtype, max(1, args.threads // tp), logs, max_num_seqs=64,
                             extra_args=extra)
    else:
        server = vllm.server(model_dir, args.dtype, args.threads, logs, max_num_seqs=64)
        if tp > 1:
            server.cmd += ["--tensor-parallel-size", str(tp)]
            # one OpenMP team per rank, on disjoint cores ("0|1")
            half = args.threads // tp
            server.env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                f"{r * half}-{(r + 1) * half - 1}" if half > 1 else str(r * half) for r in range(tp))
    server.log_path = logs / f"{system}-{model_dir.name}.log"
    return server


def allreduce_table(args: argparse.Namespace) -> dict:
    """Native shared-memory vs gloo all-reduce latencies between two processes (bf16 ``[rows, hidden]``)."""
    from xllm.core.parallel.bench import allreduce_latencies

    return allreduce_latencies(sizes=[(r, 576) for r in (1, 16, 64, 512)] + [(r, 896) for r in (1, 16, 64)],
                               iters=args.allreduce_iters)


def step_table(args: argparse.Namespace, model_dir: pathlib.Path) -> dict:
    """The eager step's time and all-reduce share, plain and overlapped, shm and gloo (two ranks, ``--threads``
    / 2 threads each)."""
    import torch

    from benchmarks.parallel_steps import step_split

    return step_split(str(model_dir), getattr(torch, args.dtype), max(1, args.threads // 2), iters=args.step_iters)


def _warm(base_url: str, model_name: str, bank) -> bool:
    warm_up(base_url, model_name, bank)
    return True  # (attempt() reads None as a failure)


def run_model(name: str, model_dir: pathlib.Path, args: argparse.Namespace, out: pathlib.Path, bank,
              results: dict, save) -> None:
    from benchmarks.peers import vllm

    systems = [s for s in args.systems if not (s == "vllm-tp2" and not heads_divide(model_dir, 2))]
    for s in set(args.systems) - set(systems):
        results["skipped"][f"{name}/{s}"] = "vLLM refuses TP=2 where the heads do not divide by 2"
    runs = results["runs"].setdefault(name, {})
    with contextlib.ExitStack() as stack:
        servers = {}
        for system in systems:
            server = start(system, model_dir, args, out / "logs")
            results["servers"][f"{name}/{system}"] = {"command": server.cmd}
            if attempt(results["errors"], f"{name}/{system}", "parallel", stack.enter_context, server) is None:
                continue
            results["servers"][f"{name}/{system}"]["startup_s"] = server.startup_seconds
            if attempt(results["errors"], f"{name}/{system}/warm-up", "parallel", _warm, server.base_url,
                       model_dir.name, bank) is None:
                continue
            servers[system] = server
            print(f"[parallel] {name} {system} up in {server.startup_seconds:.0f} s", flush=True)
            save()
        for i, c in enumerate(args.concurrency):
            n = args.num_prompts or PROMPTS.get(c, 2 * c)
            w = Workload(f"c{c}", "random", c, n, args.input_len, args.output_len)
            order = list(servers) if i % 2 == 0 else list(servers)[::-1]
            for system in order:
                def record(w, cmd, raw, raw_file, elapsed, system=system):
                    m = parse_result(raw)
                    runs.setdefault(system, {})[w.name] = {"command": cmd, "raw_file": raw_file, "metrics": m,
                                                           "elapsed_s": elapsed}
                    print(f"[parallel] {name} {system} {w.name}: {m['output_throughput']:.1f} out tok/s, TPOT p50 "
                          f"{m['tpot_ms']['p50']:.1f} ms, TTFT p50 {m['ttft_ms']['p50']:.0f} ms", flush=True)
                    save()

                def fail(w, message, system=system):
                    results["errors"][f"{name}/{system}/{w.name}"] = message
                    save()

                run_workloads(f"{name}-{system}", str(vllm.venv().python), servers[system].base_url, model_dir,
                              [w], args.seed, out, {}, record, fail)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=name_list(MODELS, "model(s)"), default=list(MODELS),
                   help="comma-separated models: smollm2, qwen05 (default: both)")
    p.add_argument("--systems", type=name_list(SYSTEMS, "system(s)"), default=list(SYSTEMS),
                   help="comma-separated systems (default: all: " + ", ".join(SYSTEMS) + ")")
    p.add_argument("--concurrency", type=int_list, default=[1, 16, 64],
                   help="comma-separated client concurrencies (default: 1,16,64)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per concurrency (default: 8 at 1, 32 at 16, 64 at 64)")
    p.add_argument("--input-len", type=int, default=128, help="random prompt tokens per request (128)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request, EOS ignored (64)")
    p.add_argument("--threads", type=int, default=2,
                   help="cores per system: TP=1 takes them all, each TP=2 rank half (2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="every server's dtype")
    p.add_argument("--seed", type=int, default=0, help="the client's --seed (0)")
    p.add_argument("--allreduce-iters", type=int, default=300, help="iterations per all-reduce size (300)")
    p.add_argument("--skip-allreduce", action="store_true", help="skip the all-reduce latency table")
    p.add_argument("--step-iters", type=int, default=20,
                   help="timed steps per shape and way of the step split (plain / overlapped; 20; 0 skips it)")
    add_output_args(p, "parallel")


def run(args: argparse.Namespace, output: Output) -> dict:
    from benchmarks.machine import cpu_busy_fraction
    from benchmarks.peers import vllm, xllm
    from benchmarks.prompts import PromptBank

    smollm2 = xllm.model_dir(None).resolve()
    out = output.open(resolve=True)
    results: dict = {"meta": output.meta(args, client_code=CLIENT_CODE, qwen05_config=QWEN05),
                     "allreduce": {}, "runs": {}, "servers": {}, "skipped": {}, "errors": {}}

    def save() -> None:
        output.save(results)

    t0 = time.monotonic()
    if not args.skip_allreduce:
        results["allreduce"] = attempt(results["errors"], "allreduce", "parallel", allreduce_table, args) or {}
        save()
    if args.step_iters > 0:
        first = smollm2 if args.models[0] == "smollm2" else qwen05_dir(smollm2)
        results["steps"] = attempt(results["errors"], "steps", "parallel", step_table, args, first) or {}
        results["steps"]["model"] = args.models[0]
        save()
    if any(s.startswith("vllm") for s in args.systems) or args.concurrency:
        print("[parallel] vLLM venv (installs vllm-cpu the first time, a few minutes) ...", flush=True)
        vllm.install()
        results["meta"]["versions"] = {"vllm": vllm.versions(), "xllm": xllm.versions()}
    for name in args.models:
        model_dir = smollm2 if name == "smollm2" else qwen05_dir(smollm2)
        results["meta"].setdefault("model_dirs", {})[name] = str(model_dir)
        run_model(name, model_dir, args, out, PromptBank(model_dir), results, save)
    results["meta"]["elapsed_s"] = time.monotonic() - t0
    results["meta"]["cpu_busy_after"] = cpu_busy_fraction()
    return results


# ---- report ---------------------------------------------------------------------------------------

def _metric(run: dict | None, key: str, stat: str | None = None) -> float | None:
    if not run:
        return None
    m = run["metrics"]
    return m.get(key) if stat is None else (m.get(key) or {}).get(stat)


def markdown(results: dict) -> str:
    meta = results.get("meta", {})
    cpu = (meta.get("machine") or {}).get("cpu_model", "?")
    lines = [f"# Tensor parallelism on the same cores ({cpu})", ""]
    ar = results.get("allreduce") or {}
    if ar.get("rows"):
        lines += ["## All-reduce between two processes (bf16, microseconds per call)", "",
                  "| shape | native shm p50 | gloo p50 | gloo / shm |", "| --- | --- | --- | --- |"]
        for row in ar["rows"]:
            shm, gloo = row.get("shm_us_p50"), row.get("gloo_us_p50")
            lines.append(f"| {row['rows']}x{row['hidden']} | {fmt(shm)} | {fmt(gloo)} | "
                         f"{fmt(gloo / shm) if shm and gloo else '–'} |")
        lines.append("")
    lines += _steps_markdown(results.get("steps") or {})
    for model, systems in (results.get("runs") or {}).items():
        lines += [f"## {model}", "", "| concurrency | system | out tok/s | vs xLLM TP=1 | TTFT p50 / p99 ms | "
                  "TPOT p50 / p99 ms | all-reduce share of TPOT (est.) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        workloads = sorted({w for runs in systems.values() for w in runs}, key=lambda w: int(w[1:]))
        layers = 30 if model == "smollm2" else QWEN05["num_hidden_layers"]
        for w in workloads:
            base = _metric(systems.get("xllm-tp1", {}).get(w), "output_throughput")
            for system, runs in systems.items():
                run = runs.get(w)
                tput = _metric(run, "output_throughput")
                share = _share(ar, system, int(w[1:]), layers, _metric(run, "tpot_ms", "p50"))
                lines.append(f"| {w[1:]} | {system} | {fmt(tput)} | {fmt(tput / base) if tput and base else '–'} | "
                             f"{fmt(_metric(run, 'ttft_ms', 'p50'))} / {fmt(_metric(run, 'ttft_ms', 'p99'))} | "
                             f"{fmt(_metric(run, 'tpot_ms', 'p50'))} / {fmt(_metric(run, 'tpot_ms', 'p99'))} | "
                             f"{share} |")
        lines.append("")
    for key, why in (results.get("skipped") or {}).items():
        lines.append(f"- skipped {key}: {why}")
    for key, err in (results.get("errors") or {}).items():  # the first line (the full text is in results.json)
        lines.append(f"- **error** {key}: {err.splitlines()[0][:300] if err else ''}")
    return "\n".join(lines) + "\n"


def _steps_markdown(steps: dict) -> list[str]:
    if not steps.get("rows"):
        return []
    lines = [f"## Eager step, two ranks: plain vs overlapped ({steps.get('model', '?')}, {steps.get('dtype')}, "
             f"{steps.get('threads')} thread(s) per rank, median of {steps.get('iters')} steps)", "",
             "Share: the time rank 0 spent blocked in collectives over the step time (overlapped: the exposed part).",
             "", "| comm | shape | rows | plain ms | overlapped ms | plain / overlapped | all-reduce share plain | "
             "all-reduce share overlapped |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in steps["rows"]:
        lines.append(f"| {r['comm']} | {r['shape']} | {r['rows']} | {fmt(r['plain_ms'])} | {fmt(r['overlap_ms'])} | "
                     f"{fmt(r['speedup'])} | {r['plain_comm_share']:.0%} | {r['overlap_comm_share']:.0%} |")
    return [*lines, ""]


def _share(ar: dict, system: str, concurrency: int, layers: int, tpot_ms: float | None) -> str:
    """2 all-reduces per layer of a decode step of ``concurrency`` rows, over the measured TPOT."""
    if not system.startswith("xllm-tp2") or not tpot_ms or not ar.get("rows"):
        return "–"
    kind = "shm" if system.endswith("shm") else "gloo"
    rows = [r for r in ar["rows"] if r["rows"] >= concurrency] or ar["rows"][-1:]
    us = rows[0].get(f"{kind}_us_p50")
    return "–" if us is None else f"{2 * layers * us / 1000 / tpot_ms:.0%}"


def plot(results: dict, out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _plot_steps(results.get("steps") or {}, out, plt)
    models = list((results.get("runs") or {}).items())
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, (model, systems) in zip(axes[0], models):
        for system, runs in systems.items():
            ws = sorted(runs, key=lambda w: int(w[1:]))
            ax.plot([int(w[1:]) for w in ws], [_metric(runs[w], "output_throughput") or 0 for w in ws], "o-",
                    label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tok/s")
        ax.set_title(model)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "parallel.png", dpi=110)
    plt.close(fig)


def _plot_steps(steps: dict, out: pathlib.Path, plt) -> None:
    """Per comm, each shape's plain and overlapped step time, the all-reduce's share hatched."""
    rows = steps.get("rows") or []
    comms = list(dict.fromkeys(r["comm"] for r in rows))
    if not comms:
        return
    fig, axes = plt.subplots(1, len(comms), figsize=(6 * len(comms), 4), squeeze=False)
    for ax, comm in zip(axes[0], comms):
        mine = [r for r in rows if r["comm"] == comm]
        for j, way in enumerate(("plain", "overlap")):
            xs = [i + (j - 0.5) * 0.4 for i in range(len(mine))]
            total = [r[f"{way}_ms"] for r in mine]
            comm_ms = [r[f"{way}_ms"] * r[f"{way}_comm_share"] for r in mine]
            ax.bar(xs, total, width=0.4, label=f"{way} step", color=f"C{j}")
            ax.bar(xs, comm_ms, width=0.4, label=f"{way}: in all-reduce", color=f"C{j}", hatch="//",
                   edgecolor="black", alpha=0.5)
        ax.set_xticks(range(len(mine)), [r["shape"] for r in mine], rotation=15)
        ax.set_ylabel("ms per step")
        ax.set_title(f"eager step, 2 ranks, {comm}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "parallel-steps.png", dpi=110)
    plt.close(fig)


SCENARIO = Scenario("parallel", "tensor parallelism: xLLM TP=1/TP=2 (shm, gloo) vs vLLM-CPU TP=1/TP=2", __doc__,
                    add_arguments, run, markdown, plot)
