"""The segmented multi-LoRA product of one projection: ``python -m benchmarks lora_kernel [--quick]``.

Per SmolLM2-135M projection (qkv: 576 -> 960 in three parts 576/192/192; o: 576 -> 576; gate_up: 576 -> 3072 in
two parts; down: 1536 -> 576), adapter rank (``--ranks``, 8 and 16), row count T (``--rows``, 1/4/16/64) and
adapters among the rows (``--adapters``, 1/4/16: row ``t`` uses slot ``t % n``, so T=1 has one), in bf16 on
``--threads`` threads, three candidates, each on the same inputs:

- ``native``: :func:`xllm.kernels.lora.native_segmented_lora`, the one-call kernel of ``kernels/cpu/lora.c``;
- ``torch_loop``: :func:`xllm.kernels.lora.torch_segmented_lora`, the loop over the step's distinct slots
  (``index_select``, two matmuls, ``index_add_``) the model ran before the kernel;
- ``base``: the base projection alone (``torch.nn.functional.linear``), what the LoRA delta is added to.

Each repetition times every candidate (``--inner`` calls in a row, the order rotated per repetition: contention
only adds time, so the report gives percentiles and the best). Reported per cell: microseconds per call
(p10 / p50 / p90 / best), ``torch_loop / native`` (> 1: the kernel faster) and ``native / base`` (the delta's
cost against the projection it rides on). ``--quick`` (tiny shapes, few repetitions) checks the code path only.
Results: ``results.json``, ``summary.md``, ``lora_kernel.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario
from xllm.common.argtypes import int_list

# name -> (in features, part output sizes): SmolLM2-135M (hidden 576, 9 heads / 3 KV heads of 64, inter 1536)
SMOLLM2 = {"qkv": (576, (576, 192, 192)), "o": (576, (576,)), "gate_up": (576, (1536, 1536)),
           "down": (1536, (576,))}
QUICK = {"qkv": (64, (64, 16, 16)), "down": (96, (64,))}
CANDIDATES = ("native", "torch_loop", "base")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int_list, default=[8, 16], help="adapter ranks (8,16)")
    p.add_argument("--rows", type=int_list, default=[1, 4, 16, 64], help="rows T of the step (1,4,16,64)")
    p.add_argument("--adapters", type=int_list, default=[1, 4, 16], help="adapters among the rows (1,4,16)")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads (2)")
    p.add_argument("--reps", type=int, default=40, help="repetitions per cell, each timing every candidate (40)")
    p.add_argument("--inner", type=int, default=20, help="calls per timing (20)")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, ranks 4, rows 1,5, adapters 1,3, 3 repetitions: the code path only")
    add_output_args(p, "lora_kernel")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def _cell(in_dim: int, sizes: tuple[int, ...], rank: int, rows: int, adapters: int, reps: int, inner: int,
          seed: int) -> dict:
    """One (projection, rank, T, adapters) cell: microseconds per call of each candidate available."""
    import torch
    import torch.nn.functional as F

    from xllm.kernels import lora

    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    out_dim, n = sum(sizes), len(sizes) * rank
    slots_n = max(adapters, 1)
    a = (torch.randn(slots_n, n, in_dim, generator=g) / in_dim ** 0.5).to(dt)
    b = torch.zeros(slots_n, out_dim, rank, dtype=dt)
    starts = [sum(sizes[:p]) for p in range(len(sizes))]
    for start, size in zip(starts, sizes, strict=True):  # each part's output rows: that part's rank columns
        b[:, start:start + size] = (torch.randn(slots_n, size, rank, generator=g) * 1e-3).to(dt)
    w = (torch.randn(out_dim, in_dim, generator=g) / in_dim ** 0.5).to(dt)
    x = torch.randn(rows, in_dim, generator=g).to(dt)
    slots = torch.arange(rows, dtype=torch.int64) % adapters
    lrows = lora.LoraRows.of(slots, [0.5] * slots_n)
    layout = lora.LoraLayout.of(rank, [(p, s, z) for p, (s, z) in enumerate(zip(starts, sizes, strict=True))])
    out = F.linear(x, w)
    fns = {"native": lambda: lora.native_segmented_lora(x, out, a, b, lrows, layout),
           "torch_loop": lambda: lora.torch_segmented_lora(x, out, a, b, lrows, layout),
           "base": lambda: F.linear(x, w)}
    if not lora.native_segmented_lora(x, out, a, b, lrows, layout):
        del fns["native"]
    for f in fns.values():  # warm-up
        f()
    times: dict[str, list[float]] = {c: [] for c in fns}
    names = list(fns)
    for r in range(reps):
        for c in names[r % len(names):] + names[:r % len(names)]:
            f = fns[c]
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            times[c].append((time.perf_counter() - t0) / inner * 1e6)
    cell = {"in": in_dim, "parts": list(sizes), "rank": rank, "rows": rows, "adapters": adapters,
            "distinct": len(lrows.groups), "us": {}}
    for c, ts in times.items():
        cell["us"][c] = {"p10": _pct(ts, 0.1), "p50": statistics.median(ts), "p90": _pct(ts, 0.9), "best": min(ts)}
    us = cell["us"]
    if "native" in us:
        cell["torch_over_native"] = us["torch_loop"]["p50"] / us["native"]["p50"]
        cell["native_over_base"] = us["native"]["p50"] / us["base"]["p50"]
    cell["torch_over_base"] = us["torch_loop"]["p50"] / us["base"]["p50"]
    return cell


def run(args: argparse.Namespace, output: Output) -> dict:
    import torch

    from xllm.kernels import native

    torch.set_num_threads(args.threads)
    shapes = QUICK if args.quick else SMOLLM2
    ranks = [4] if args.quick else args.ranks
    row_counts = [1, 5] if args.quick else args.rows
    adapter_counts = [1, 3] if args.quick else args.adapters
    reps, inner = (3, 2) if args.quick else (args.reps, args.inner)
    output.open()
    results: dict = {"meta": output.meta(args, busy=not args.quick, torch=torch.__version__,
                                         native=native.unavailable_reason() or "available"),
                     "cells": [], "errors": {}}
    seed = 0
    for name, (in_dim, sizes) in shapes.items():
        for rank in ranks:
            for rows in row_counts:
                # (more adapters than rows is the same cell as one adapter per row: measured once)
                for adapters in dict.fromkeys(min(a, rows) for a in adapter_counts):
                    seed += 1
                    cell = _cell(in_dim, sizes, rank, rows, adapters, reps, inner, seed)
                    cell["projection"] = name
                    results["cells"].append(cell)
                    us = cell["us"]
                    nat = f"native {us['native']['p50']:.1f} us, " if "native" in us else "no native, "
                    print(f"{name} r={rank} T={rows} adapters={adapters}: {nat}torch loop "
                          f"{us['torch_loop']['p50']:.1f} us, base {us['base']['p50']:.1f} us", flush=True)
                    output.save(results)
    return results


def summary(results: dict) -> str:
    cpu = results["meta"].get("machine", {}).get("cpu_model", "?")
    threads = results["meta"].get("threads", "?")
    lines = [f"# Segmented LoRA product per projection, bf16 ({cpu}, {threads} threads)", "",
             f"Native kernels: {results['meta'].get('native', '?')}. Microseconds per call, p50 (p90).", "",
             "| projection | rank | rows | adapters | base | torch loop | native | torch loop / native | "
             "native / base |", "|---|---|---|---|---|---|---|---|---|"]

    def us(cell: dict, c: str) -> str:
        u = cell["us"].get(c)
        return "-" if u is None else f"{u['p50']:.1f} ({u['p90']:.1f})"

    for cell in results["cells"]:
        ratio = f"{cell['torch_over_native']:.2f}" if "torch_over_native" in cell else "-"
        over = f"{cell['native_over_base']:.2f}" if "native_over_base" in cell else "-"
        lines.append(f"| {cell['projection']} | {cell['rank']} | {cell['rows']} | {cell['distinct']} | "
                     f"{us(cell, 'base')} | {us(cell, 'torch_loop')} | {us(cell, 'native')} | {ratio} | {over} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out_dir) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    projections = list(dict.fromkeys(c["projection"] for c in results["cells"]))
    fig, axes = plt.subplots(1, len(projections), figsize=(4 * len(projections), 3.5), squeeze=False)
    for ax, name in zip(axes[0], projections, strict=True):
        cells = [c for c in results["cells"] if c["projection"] == name and "torch_over_native" in c]
        for key in sorted({(c["rank"], c["adapters"]) for c in cells}):
            line = sorted((c["rows"], c["torch_over_native"]) for c in cells if (c["rank"], c["adapters"]) == key)
            ax.plot([r for r, _ in line], [v for _, v in line], marker="o", label=f"r={key[0]}, {key[1]} adapters")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows T")
        ax.set_title(name)
    axes[0][0].set_ylabel("torch loop / native (p50)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Segmented LoRA: native kernel speed-up over the per-adapter torch loop")
    fig.tight_layout()
    path = out_dir / "lora_kernel.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]


SCENARIO = Scenario("lora_kernel", "segmented multi-LoRA product: native kernel vs per-adapter torch loop vs base",
                    __doc__, add_arguments, run, summary, plot)
