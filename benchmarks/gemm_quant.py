"""Quantized-weight GEMM benchmark: y[M,N] = x[M,K] . dequant(W)[N,K]^T per format, shape and M, our
native kernels (``kernels/cpu/gemm_quant.{h,c}``) against the native bf16 GEMV, on 2 threads.

    python -m benchmarks gemm_quant                                  # SmolLM2 shapes, every format, M 1..8 + 16..256
    python -m benchmarks gemm_quant --formats q4_1,q8_0 --ms 1 --shapes 576x576
    python -m benchmarks gemm_quant --report benchmarks/results/gemm_quant-20261123-101500

Candidates per (format, shape, M), all with bf16 activations:

- ``vnni`` (M <= 8): the skinny GEMV, activations quantized to int8 per 32-block, VPDPBUSD;
- ``bf16dot``: the panel path (weights dequantized in registers into the blocked bf16 GEMM's layout,
  VDPBF16PS); the large-M path;
- ``chunks`` (M > 8): the skinny GEMV over chunks of 8 rows;
- ``bf16`` (M <= 8): the native bf16 GEMV (``kernels/cpu/gemm.c``) on the unquantized bf16 weight.

Timing: each sample is one native call that runs ``reps`` passes over ``copies`` weights of the shape
(together larger than the 32 MB L3, so the weights stream from DRAM as a model's layers do), so neither
the ctypes call nor cache reuse flatters the figure. Candidates are interleaved (order rotated per
sample); the report gives the median. ``GB/s`` = bytes of the packed weight streamed per second (the
format's own bytes: data + scales + zeros), ``% roofline`` against ``--roofline-gbs`` (31 GB/s: the
2-thread read bandwidth of ``docs/performance.md``). ``GB/s cpu`` divides by the process's CPU time per
thread instead of the wall time: on a shared machine it leaves out the time other processes held the
cores (it still counts OpenMP barrier spinning), so it is the figure to read when the CPUs were busy.
Accuracy: relative error of each path against the fp32 product of the dequantized weight
(max |y - ref| / max |ref| and the RMS ratio), on one copy.

Results: ``results.json`` and ``summary.md`` in ``--out`` (default ``benchmarks/results/gemm_quant-<timestamp>``).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import sys
import time

from benchmarks.gemm_common import weight_shapes
from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario
from xllm.common.argtypes import int_list

SHAPES = {"o": (576, 576), "kv": (192, 576), "up": (1536, 576), "down": (576, 1536), "lm_head": (49152, 576)}
FORMATS = ("q4_1", "q8_0", "q4_0", "int8", "int4_g32", "int4_g128")
MS = (1, 2, 4, 8, 16, 64, 256)
CANDIDATES = ("vnni", "bf16dot", "chunks", "bf16")
_PATH = {"vnni": "gemv", "bf16dot": "panels", "chunks": "gemv_chunks"}


def _accuracy(y, ref) -> dict:
    d = (y.float() - ref)
    return {"rel_max": float(d.abs().max() / ref.abs().max()), "rel_rms": float(d.pow(2).mean().sqrt()
                                                                               / ref.pow(2).mean().sqrt())}


def _run(call: functools.partial, reps: int) -> None:
    """A ``*_many`` measurement call with its repetition count (its third argument) set to ``reps``."""
    args = list(call.args)
    args[2] = reps
    call.func(*args)


def measure(formats: list[str], shapes: dict[str, tuple[int, int]], ms: list[int], budget: float,
            min_bytes: int, threads: int, progress: bool = True) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from xllm.kernels import quant, quant_native

    lib = quant_native.library()
    if lib is None:
        raise RuntimeError("the native quantized kernels are unavailable here (XLLM_NATIVE=0, no AVX512-VNNI?)")
    vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    qmany = lib.fn("xllm_quant_linear_many", [ctypes.POINTER(quant_native.QWeight), i64, i64, vp, i32, i64, i64, i64,
                                              vp, i32, i32])
    bmany = lib.fn("xllm_gemm_bf16_many", [ctypes.POINTER(vp), i64, i64, vp, i64, i64, i64, vp])
    rows = []
    for sname, (n, k) in shapes.items():
        gen = torch.Generator().manual_seed(n * 7 + k)
        w = torch.randn(n, k, generator=gen) * k**-0.5
        wb = w.to(torch.bfloat16)
        bcopies = max(1, -(-min_bytes // (n * k * 2)))
        bf16_ws = [wb.clone() for _ in range(bcopies)]
        bptrs = (vp * bcopies)(*[t.data_ptr() for t in bf16_ws])
        for fmt in formats:
            if not quant.supports(fmt, k):
                continue
            qw = quant_native.kernel_ready(quant.quantize(w, fmt))
            copies = max(1, -(-min_bytes // qw.nbytes()))
            qws = [quant_native.kernel_ready(quant.quantize(w, fmt)) if i == 0 else
                   type(qw)(qw.fmt, n, k, qw.data.clone(), None if qw.scales is None else qw.scales.clone(),
                            None if qw.zeros is None else qw.zeros.clone()) for i in range(copies)]
            structs = (quant_native.QWeight * copies)(*[quant_native.struct(q) for q in qws])
            deq = quant.dequantize(qw)
            for m in ms:
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
                y = torch.empty(m, n, dtype=torch.bfloat16)
                ref = F.linear(x.float(), deq)
                cands = {}
                for c, path in _PATH.items():
                    if (c == "vnni" and m > 8) or (c == "chunks" and m <= 8):
                        continue
                    cands[c] = (functools.partial(qmany, structs, copies, ctypes.c_int64(0), x.data_ptr(), 1, m, k,
                                                  n, y.data_ptr(), 1, quant_native.PATHS[path]),
                                qw.nbytes() * copies)
                if m <= 8:
                    cands["bf16"] = (functools.partial(bmany, bptrs, bcopies, ctypes.c_int64(0), x.data_ptr(), m, k,
                                                       n, y.data_ptr()), n * k * 2 * bcopies)
                acc = {c: _accuracy(quant_native.linear(x, qw, None, None, _PATH[c]), ref)
                       for c in cands if c in _PATH}
                acc["bf16"] = _accuracy(F.linear(x, wb).float(), F.linear(x.float(), w))
                # calibrate reps so that one sample takes ~20 ms
                reps = {}
                for c, (fn, _) in cands.items():
                    _run(fn, 1)
                    t0 = time.perf_counter()
                    _run(fn, 1)
                    reps[c] = max(1, int(0.02 / max(time.perf_counter() - t0, 1e-6)))
                samples = max(5, min(40, int(budget / (0.02 * len(cands)))))
                times: dict[str, list[float]] = {c: [] for c in cands}
                cpu: dict[str, list[float]] = {c: [] for c in cands}
                names = list(cands)
                for s in range(samples):
                    for c in names[s % len(names):] + names[:s % len(names)]:
                        t0, c0 = time.perf_counter(), time.process_time()
                        _run(cands[c][0], reps[c])
                        times[c].append((time.perf_counter() - t0) / reps[c])
                        cpu[c].append((time.process_time() - c0) / reps[c] / threads)
                row = {"format": fmt, "shape": sname, "n": n, "k": k, "m": m, "weight_bytes": qw.nbytes(),
                       "copies": copies, "samples": samples, "cands": {}}
                for c, ts in times.items():
                    med = statistics.median(ts)
                    nbytes = cands[c][1]
                    row["cands"][c] = {"median_us": med * 1e6 / (copies if c != "bf16" else bcopies),
                                       "gbs": nbytes / med / 1e9, "gbs_best": nbytes / min(ts) / 1e9,
                                       "gbs_cpu": nbytes / statistics.median(cpu[c]) / 1e9,
                                       **acc.get(c, {})}
                rows.append(row)
                if progress:
                    print(f"[gemm_quant] {fmt} {sname} [{n}x{k}] M={m}: " + ", ".join(
                        f"{c} {v['median_us']:.1f}us {v['gbs']:.1f}GB/s (cpu {v['gbs_cpu']:.1f})"
                        for c, v in row["cands"].items()),
                        flush=True)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    roof = meta["roofline_gbs"]
    lines = [f"# Quantized GEMM kernels ({meta['timestamp']})", "",
             f"Commit {meta.get('commit') or '?'}, {meta['threads']} threads; CPU busy before/after (other "
             f"processes): {_pct(meta.get('cpu_busy_before'))} / {_pct(meta.get('cpu_busy_after'))}. "
             f"GB/s = the format's bytes streamed per second (median; weights larger than the L3 in total), "
             f"% = of {roof:.0f} GB/s; in brackets GB/s over CPU time per thread (the figure to read when the "
             "CPUs were busy); time per call in µs; error = max |y - ref| / max |ref| against the fp32 "
             "product of the dequantized weight (bf16: of the bf16 weight against the fp32 one).", "",
             "| format | shape | N x K | M | " + " | ".join(f"{c} µs / GB/s (%) / err" for c in CANDIDATES) + " |",
             "|---|---|---|---:|" + "---|" * len(CANDIDATES)]
    for r in rows:
        cells = []
        for c in CANDIDATES:
            v = r["cands"].get(c)
            cells.append("" if v is None else f"{v['median_us']:.1f} / {v['gbs']:.1f} ({100 * v['gbs'] / roof:.0f}%)"
                         + f" [{v.get('gbs_cpu', float('nan')):.1f}]"
                         + (f" / {v['rel_max']:.4f}" if "rel_max" in v else ""))
        lines.append(f"| {r['format']} | {r['shape']} | {r['n']}x{r['k']} | {r['m']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pct(v) -> str:
    return "?" if v is None else f"{100 * v:.0f}%"


def summary(results: dict) -> str:
    return markdown(results["rows"], results["meta"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--formats", type=lambda t: [f.strip() for f in t.split(",") if f.strip()], default=list(FORMATS),
                   help=f"comma-separated formats (default {','.join(FORMATS)})")
    p.add_argument("--shapes", type=weight_shapes, default=dict(SHAPES),
                   help="comma-separated NxK or name=NxK weight shapes (default: SmolLM2-135M's o, k/v, up, down, "
                        "lm_head)")
    p.add_argument("--ms", type=int_list, default=list(MS),
                   help="comma-separated row counts (default 1,2,4,8,16,64,256)")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads (2)")
    p.add_argument("--budget", type=float, default=0.6, metavar="SECONDS",
                   help="time per (format, shape, M) cell: sets the samples (5..40; default 0.6)")
    p.add_argument("--min-mib", type=int, default=96,
                   help="weight copies per shape add up to at least this many MiB (default 96, 3x the L3)")
    p.add_argument("--roofline-gbs", type=float, default=31.0, help="the read bandwidth to compare with (31 GB/s)")
    add_output_args(p, "gemm_quant")


def run(args: argparse.Namespace, output: Output) -> dict | int:
    import torch

    from benchmarks.machine import cpu_busy_fraction
    from xllm.kernels import quant

    bad = [f for f in args.formats if f not in quant.FORMATS]
    if bad:
        print(f"python -m benchmarks gemm_quant: error: unknown format(s) {bad}; choose from {quant.FORMATS}",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    output.open()
    meta = output.meta(threads=args.threads, formats=args.formats,
                       shapes={k: list(v) for k, v in args.shapes.items()}, ms=args.ms, budget_s=args.budget,
                       roofline_gbs=args.roofline_gbs, torch=torch.__version__)
    rows = measure(args.formats, args.shapes, args.ms, args.budget, args.min_mib << 20, args.threads)
    meta["cpu_busy_after"] = cpu_busy_fraction()
    return {"meta": meta, "rows": rows}


SCENARIO = Scenario("gemm_quant", "quantized-weight GEMV/GEMM per format: GB/s, accuracy", __doc__, add_arguments,
                    run, summary)
