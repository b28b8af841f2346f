"""GEMM benchmark: y[M,N] = x[M,K] . W[N,K]^T per weight shape and row count M, our native kernels
against oneDNN, on torch's threads (2 by default).

    python -m benchmarks gemm                                   # SmolLM2-135M shapes, M 1..2048, bf16 + fp32
    python -m benchmarks gemm --shapes 3072x576 --ms 16,64 --dtypes bfloat16
    python -m benchmarks gemm --report benchmarks/results/gemm-20261123-101500

Candidates per (dtype, shape, M):

- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on a ``_reorder_linear_weight`` copy (what
  ``xllm.kernels.linear`` used for M > 8 before the packed kernel);
- ``torch``: plain ``F.linear``;
- ``skinny``: the native skinny GEMV of ``kernels/cpu/gemm.c`` (M <= 8 only);
- ``packed``: the native blocked GEMM over packed weights (``kernels/cpu/gemm_packed.{h,c}``), as the
  model runs it (bf16 from 2 rows on AMX where the CPU has it); on an AMX CPU also its two kernels forced,
  ``packed_avx512`` (``vdpbf16ps``) and ``packed_amx`` (``gemm_packed_amx.h``, K % 32 == 0);
- ``int8`` (bf16 only, with ``--int8``): the ``w8a8`` format's int8 GEMM (``kernels/cpu/gemm_w8a8.h``: VNNI
  tiles, or AMX-INT8 ones where the CPU has them) with the activation quantization included in the time; on an
  AMX-INT8 CPU also ``int8_vnni``, its VNNI tiles forced.

Each repetition runs every candidate once, in an order rotated per repetition (the machine is shared
and noisy: contention only ever adds time, so the report gives medians and the per-candidate best);
the repetition count fits ``--budget`` seconds per (dtype, shape, M). Reported: GFLOP/s (2MNK / time),
GB/s of weights (weight bytes / time: against the ~32 GB/s of DRAM for the memory-bound small M) and
the speed ratio packed/oneDNN (> 1: ours faster).

Results: ``results.json``, ``summary.md`` and ``gemm.png`` in ``--out`` (default
``benchmarks/results/gemm-<timestamp>``).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

from benchmarks.gemm_common import w8a8_linear, weight_shapes
from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario
from xllm.common.argtypes import int_list

SMOLLM2_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                  "lm_head": (49152, 576)}
MS = (1, 4, 8, 9, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048)
CANDIDATES = ("onednn", "torch", "skinny", "packed", "packed_avx512", "packed_amx", "int8", "int8_vnni")


def _candidates(dtype, w, ms_max: int, int8: bool) -> dict[str, Callable]:
    """name -> fn(x) for the candidates available for this weight (dtype: a torch dtype)."""
    import torch
    import torch.nn.functional as F

    from xllm.kernels import gemm, native
    from xllm.kernels.linear import linear

    out: dict[str, Callable] = {}
    k = w.shape[1]
    od = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    out["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, od, None, "none", [], "")
    out["torch"] = lambda x: F.linear(x, w)
    if native.library() is not None:
        out["skinny"] = lambda x: linear(x, w)  # routed to gemm.c when M <= 8
        pw = gemm.pack(w)
        if pw is not None:
            out["packed"] = lambda x: gemm.packed_linear(x, pw)
            if dtype == torch.bfloat16 and gemm.amx_ready():  # the two kernels behind "packed", forced
                out["packed_avx512"] = lambda x: gemm.packed_linear(x, pw, path="avx512")
                if k % 32 == 0:
                    out["packed_amx"] = lambda x: gemm.packed_linear(x, pw, path="amx")
        if int8 and dtype == torch.bfloat16:
            fn = w8a8_linear(w)
            if fn is not None:
                out["int8"] = fn
                from xllm.kernels import quant_native

                if quant_native.amx_int8_ready():
                    out["int8_vnni"] = w8a8_linear(w, path="w8a8_vnni")
    return out


def measure(shapes: dict[str, tuple[int, int]], ms: list[int], dtypes: list[str], budget: float, int8: bool,
            progress: bool = True) -> list[dict]:
    import torch

    rows = []
    for dname in dtypes:
        dtype = getattr(torch, dname)
        es = torch.tensor([], dtype=dtype).element_size()
        for sname, (n, k) in shapes.items():
            gen = torch.Generator().manual_seed(n * 7 + k)
            w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
            cands = _candidates(dtype, w, max(ms), int8)
            for m in ms:
                x = torch.randn(m, k, generator=gen).to(dtype)
                active = {c: f for c, f in cands.items() if c != "skinny" or m <= 8}
                start = time.perf_counter()
                for f in active.values():  # warm-up: oneDNN makes its primitive for this M, pages get touched
                    f(x)
                once = time.perf_counter() - start
                reps = max(5, min(200, int(budget / max(once, 1e-6))))
                times: dict[str, list[float]] = {c: [] for c in active}
                names = list(active)
                for r in range(reps):
                    for c in names[r % len(names):] + names[:r % len(names)]:
                        t0 = time.perf_counter()
                        active[c](x)
                        times[c].append(time.perf_counter() - t0)
                flops, wbytes = 2.0 * m * n * k, float(n * k * es)
                row = {"dtype": dname, "shape": sname, "n": n, "k": k, "m": m, "reps": reps, "cands": {}}
                for c, ts in times.items():
                    med, best = statistics.median(ts), min(ts)
                    row["cands"][c] = {"median_us": med * 1e6, "best_us": best * 1e6, "gflops": flops / med / 1e9,
                                       "weight_gbs": wbytes / med / 1e9, "gflops_best": flops / best / 1e9}
                if "packed" in times and "onednn" in times:
                    row["packed_vs_onednn"] = (statistics.median(times["onednn"]) / statistics.median(times["packed"]))
                    row["packed_vs_onednn_best"] = min(times["onednn"]) / min(times["packed"])
                rows.append(row)
                if progress:
                    print(f"[gemm] {dname} {sname} [{n}x{k}] M={m}: " + ", ".join(
                        f"{c} {v['gflops']:.0f}" for c, v in row["cands"].items()) + " GFLOP/s", flush=True)
    return rows


# ---- report -------------------------------------------------------------------------------------

def markdown(rows: list[dict], meta: dict) -> str:
    m = meta.get("machine", {})
    lines = [f"# GEMM kernels: ours vs oneDNN ({meta['timestamp']})", "",
             f"Commit {meta.get('commit') or '?'} on {m.get('cpu_model', '?')}, {meta['threads']} threads; "
             f"CPU busy before/after (other processes): {_pct(meta.get('cpu_busy_before'))} / "
             f"{_pct(meta.get('cpu_busy_after'))}. Median over interleaved repetitions; GFLOP/s = 2MNK/time, "
             "weights GB/s = weight bytes/time; `packed/oneDNN` > 1 means ours is faster "
             "(median; in brackets the ratio of the best times).", ""]
    cands = [c for c in CANDIDATES if any(c in r["cands"] for r in rows)]
    for dname in dict.fromkeys(r["dtype"] for r in rows):
        lines += [f"## {dname}", "",
                  "| shape | N x K | M | " + " | ".join(f"{c} GFLOP/s" for c in cands)
                  + " | packed weights GB/s | packed/oneDNN |",
                  "|---|---|---:|" + "---:|" * len(cands) + "---:|---:|"]
        for r in (r for r in rows if r["dtype"] == dname):
            cells = [f"{r['cands'][c]['gflops']:.0f}" if c in r["cands"] else "" for c in cands]
            pk = r["cands"].get("packed")
            ratio = (f"{r['packed_vs_onednn']:.2f} ({r['packed_vs_onednn_best']:.2f})"
                     if "packed_vs_onednn" in r else "")
            tail = f" | {pk['weight_gbs']:.1f} | {ratio} |" if pk else " |  |  |"
            lines.append(f"| {r['shape']} | {r['n']}x{r['k']} | {r['m']} | " + " | ".join(cells) + tail)
        lines.append("")
    return "\n".join(lines)


def _pct(v) -> str:
    return "?" if v is None else f"{100 * v:.0f}%"


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """GFLOP/s vs M per shape (columns) and dtype (rows), one line per candidate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(len(dtypes), len(shapes), figsize=(3.6 * len(shapes), 3.2 * len(dtypes)),
                             squeeze=False, sharex=True)
    for i, d in enumerate(dtypes):
        for j, s in enumerate(shapes):
            ax = axes[i][j]
            sel = [r for r in rows if r["dtype"] == d and r["shape"] == s]
            for c in CANDIDATES:
                pts = [(r["m"], r["cands"][c]["gflops"]) for r in sel if c in r["cands"]]
                if pts:
                    ax.plot(*zip(*pts), marker=".", label=c)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{d} {s} [{sel[0]['n']}x{sel[0]['k']}]" if sel else s, fontsize=9)
            ax.grid(True, alpha=0.3)
            if j == 0:
                ax.set_ylabel("GFLOP/s")
            if i == len(dtypes) - 1:
                ax.set_xlabel("M (rows)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(results: dict) -> str:
    return markdown(results["rows"], results["meta"])


def plot_png(results: dict, out: pathlib.Path) -> None:
    if results["rows"]:
        plot(results["rows"], out / "gemm.png")


# ---- command line -------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", type=weight_shapes, default=dict(SMOLLM2_SHAPES),
                   help="comma-separated NxK or name=NxK weight shapes (default: SmolLM2-135M's qkv, o, gate_up, "
                        "down, lm_head)")
    p.add_argument("--ms", type=int_list, default=list(MS), help="comma-separated row counts (default 1..2048)")
    p.add_argument("--dtypes", type=lambda t: [d.strip() for d in t.split(",") if d.strip()],
                   default=["bfloat16", "float32"], help="comma-separated of bfloat16,float32 (default both)")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads (2)")
    p.add_argument("--budget", type=float, default=0.3, metavar="SECONDS",
                   help="time per (dtype, shape, M) cell: sets the repetitions (5..200; default 0.3)")
    p.add_argument("--int8", action="store_true",
                   help="add the w8a8 format's int8 GEMM (bf16 only; on AMX-INT8 CPUs its VNNI tiles as well)")
    add_output_args(p, "gemm")


def run(args: argparse.Namespace, output: Output) -> dict | int:
    bad = [d for d in args.dtypes if d not in ("bfloat16", "float32")]
    if bad:
        print(f"python -m benchmarks gemm: error: unknown dtype(s) {bad}", file=sys.stderr)
        return 2
    import torch

    from benchmarks.machine import cpu_busy_fraction

    torch.set_num_threads(args.threads)
    output.open()
    meta = output.meta(threads=args.threads, shapes={k: list(v) for k, v in args.shapes.items()}, ms=args.ms,
                       dtypes=args.dtypes, budget_s=args.budget, torch=torch.__version__)
    rows = measure(args.shapes, args.ms, args.dtypes, args.budget, args.int8)
    meta["cpu_busy_after"] = cpu_busy_fraction()
    return {"meta": meta, "rows": rows}


SCENARIO = Scenario("gemm", "GEMM kernels per shape and row count: ours vs oneDNN", __doc__, add_arguments, run,
                    summary, plot_png)
