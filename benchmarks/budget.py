"""Token budget sweep: the xLLM server's ``--max-num-batched-tokens`` against goodput under a TTFT +
TPOT SLO, measured with vLLM's own benchmark client (the ``serve-client`` machinery).

    python -m benchmarks budget                                         # 256..4096, two workloads
    python -m benchmarks budget --budgets 512,2048 --workloads sharegpt-c16 --slo-ttft-ms 1500

For each budget the xLLM server is started with ``--max-num-batched-tokens B`` (everything else at
its defaults), warmed up, and every workload (:data:`benchmarks.vllm_client.WORKLOADS`) is run
against it by vLLM's client with ``--goodput ttft:T tpot:P``: vLLM counts a request as good when its
TTFT and its TPOT are both within the SLO, and reports good requests per second
(``request_goodput``). The budget with the highest goodput (ties: the higher output throughput) is
the measured choice for the engine's default. Results: ``results.json``, ``summary.md`` and
``budget.png`` in ``--out`` (default ``benchmarks/results/budget-<timestamp>``).
"""

from __future__ import annotations

import argparse
import pathlib

from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario
from xllm.common.argtypes import int_list

BUDGETS = (256, 512, 1024, 2048, 4096)
DEFAULT_WORKLOADS = ("random-128-64-c16", "sharegpt-c16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from benchmarks.vllm_client import WORKLOADS

    p.add_argument("--budgets", type=int_list, default=list(BUDGETS), help="comma-separated token budgets")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help=f"comma-separated serve-client workloads (of: {', '.join(WORKLOADS)})")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per workload (default: the workload's)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT SLO of a good request (ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="TPOT SLO of a good request (ms)")
    p.add_argument("--threads", type=int, default=2, help="the server's threads")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the server's dtype")
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled SmolLM2)")
    p.add_argument("--seed", type=int, default=0, help="the client's seed (prompt sampling)")
    p.add_argument("--xllm-args", default="", metavar="'FLAGS'", help="more flags for every xLLM server")
    add_output_args(p, "budget", report=False)


def run(args: argparse.Namespace, output: Output) -> dict:
    from benchmarks.machine import cpu_busy_fraction
    from benchmarks.peers import vllm, xllm
    from benchmarks.prompts import PromptBank
    from benchmarks.serve_client_report import parse_result
    from benchmarks.vllm_client import (
        WORKLOADS,
        Workload,
        make_sharegpt_files,
        run_workloads,
        warm_up,
    )

    workloads = [WORKLOADS[n] for n in args.workloads.split(",") if n]
    if args.num_prompts:
        workloads = [Workload(w.name, w.dataset, w.concurrency, args.num_prompts, w.input_len, w.output_len,
                              w.description) for w in workloads]
    model_dir = xllm.model_dir(args.model).resolve()
    out = output.open(resolve=True)
    (out / "raw").mkdir(exist_ok=True)
    python = str(vllm.install().python)
    bank = PromptBank(model_dir)
    datasets, _, _ = make_sharegpt_files(workloads, bank, out, args.seed)
    goodput = ("--goodput", f"ttft:{args.slo_ttft_ms:g}", f"tpot:{args.slo_tpot_ms:g}")
    results: dict = {"meta": output.meta(args, argv=False), "runs": {}, "errors": {}}

    def save() -> None:
        output.save(results)

    for budget in args.budgets:
        extra = ["--served-model-name", model_dir.name, "--max-num-batched-tokens", str(budget),
                 *args.xllm_args.split()]
        server = xllm.server(model_dir, args.dtype, args.threads, out / "logs", max_num_seqs=64, extra_args=extra)
        with server:
            xllm.wait_instances(server.base_url, 1)
            warm_up(server.base_url, model_dir.name, bank)

            def fail(w: Workload, message: str, budget: int = budget) -> None:
                results["errors"][f"{budget}/{w.name}"] = message
                save()

            def record(w: Workload, cmd: list[str], raw: dict, raw_file: str, elapsed: float,
                       budget: int = budget) -> None:
                m = parse_result(raw)
                m["request_goodput"] = raw.get("request_goodput")
                results["runs"].setdefault(w.name, {})[str(budget)] = m
                print(f"[budget] {budget} / {w.name}: goodput {m['request_goodput']} req/s, "
                      f"{m['output_throughput']:.1f} out tok/s, TTFT p50 {m['ttft_ms']['p50']:.0f} ms, "
                      f"TPOT p50 {m['tpot_ms']['p50']:.1f} ms ({elapsed:.0f} s)", flush=True)
                save()

            run_workloads(f"b{budget}", python, server.base_url, model_dir, workloads, args.seed, out, datasets,
                          record, fail, extra=goodput)
    results["meta"]["cpu_busy_after"] = cpu_busy_fraction()
    return results


def best_budget(runs: dict[str, dict]) -> str | None:
    """The budget with the highest goodput (ties: higher output throughput)."""
    scored = [(m.get("request_goodput") or 0.0, m.get("output_throughput") or 0.0, b) for b, m in runs.items()]
    return max(scored)[2] if scored else None


def summary(results: dict) -> str:
    meta = results["meta"]
    lines = [f"# Token budget sweep (commit {meta['commit']})", "",
             f"Good request: TTFT <= {meta['slo_ttft_ms']:g} ms and TPOT <= {meta['slo_tpot_ms']:g} ms "
             f"(vLLM's `--goodput`). CPU busy before/after: {meta['cpu_busy_before'] or 0:.0%} / "
             f"{meta.get('cpu_busy_after') or 0:.0%}.", ""]
    for name, runs in results["runs"].items():
        best = best_budget(runs)
        lines += [f"## {name} (best: {best})", "",
                  "| budget | goodput req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | "
                  "ITL p99 ms |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for b, m in sorted(runs.items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {b} | {m.get('request_goodput') or 0:.2f} | {m['output_throughput']:.1f} | "
                         f"{m['ttft_ms']['p50']:.0f} | {m['ttft_ms']['p99']:.0f} | {m['tpot_ms']['p50']:.1f} | "
                         f"{m['tpot_ms']['p99']:.1f} | {m['itl_ms']['p99']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, runs in results["runs"].items():
        budgets = sorted(runs, key=int)
        axes[0].plot([int(b) for b in budgets], [runs[b].get("request_goodput") or 0 for b in budgets], "o-",
                     label=name)
        axes[1].plot([int(b) for b in budgets], [runs[b]["ttft_ms"]["p50"] for b in budgets], "o-", label=name)
    for ax, label in zip(axes, ("goodput (req/s within SLO)", "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("--max-num-batched-tokens")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



def plot_png(results: dict, out: pathlib.Path) -> None:
    plot(results, out / "budget.png")


SCENARIO = Scenario("budget", "the token budget against goodput under a TTFT + TPOT SLO", __doc__.split("\n\n")[0],
                    add_arguments, run, summary, plot_png)
