"""Prefill attention: the per-chunk torch SDPA path vs the native varlen kernel (one call per step).

SmolLM2-135M shapes by default (9 query heads, 3 KV heads, head_dim 64, bf16) over a slot-addressed
cache. Cases: one fresh chunk of 128/512/2048 tokens, a 256-token chunk after a 1024-token prefix,
16 fresh chunks of 128, and a mixed step of 15 decode rows + one 128-token chunk (old: the native
decode kernel for the decode rows plus SDPA for the chunk, as ``SlotAttention`` ran them; new: one
varlen call for all rows). Also the prefill KV write: ``k_cache[slots, positions] = k`` (index_put)
vs ``write_kv_rows``. Old and new run interleaved; medians per case.

Decode rows (``--decode``): R rows of C context tokens through the native varlen call, once per layer
over per-layer caches (as many layers as fit ~1 GB, so the KV comes from DRAM, not the LLC), as GB/s of
K+V read, beside the read bandwidth of ``torch.sum`` over a 1 GiB bf16 tensor in the same run. With
``--baseline-src DIR`` (e.g. ``git archive main kernels/cpu | tar -x -C /tmp/base``, then
``/tmp/base/kernels/cpu``) the same calls also run on a library built from those kernel sources,
interleaved with the current one: a before/after of a kernel change in one run.

    python -m benchmarks attention_bench [--threads 2] [--reps 15] [--dtype bf16]
    python -m benchmarks attention_bench --decode [--baseline-src DIR] [--reps 9]
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.scenario import Output, Scenario
from xllm.kernels import native
from xllm.kernels.attention import (
    _native_prefill_attention,
    _sdpa_prefill_attention,
    decode_attention,
    write_kv_rows,
)

HEADS, KV_HEADS, DIM = 9, 3, 64
CASES: list[tuple[str, list[tuple[int, int]]]] = [  # (name, [(chunk rows, context)]); rows == 1: decode
    ("chunk 128", [(128, 128)]),
    ("chunk 512", [(512, 512)]),
    ("chunk 2048", [(2048, 2048)]),
    ("chunk 256 after 1024", [(256, 1280)]),
    ("16 x chunk 128", [(128, 128)] * 16),
    ("15 decodes (ctx 300-1000) + chunk 128", [(1, 300 + 50 * i) for i in range(15)] + [(128, 128)]),
]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _flops(seqs: list[tuple[int, int]]) -> float:
    """Multiply-adds x2 of QK^T and PV over the causal (unmasked) pairs."""
    pairs = sum(sum(ctx - n + r + 1 for r in range(n)) for n, ctx in seqs)
    return 2.0 * pairs * HEADS * (DIM + DIM)


def _case(seqs: list[tuple[int, int]], dtype: torch.dtype, reps: int) -> dict:
    max_len = max(ctx for _, ctx in seqs)
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(len(seqs), max_len, KV_HEADS, DIM, generator=gen).to(dtype)
    v_cache = torch.randn(len(seqs), max_len, KV_HEADS, DIM, generator=gen).to(dtype)
    slots = list(range(len(seqs)))
    starts = [0]
    for n, _ in seqs:
        starts.append(starts[-1] + n)
    qkv = torch.randn(starts[-1], (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(dtype)
    q = qkv[:, :HEADS * DIM].view(-1, HEADS, DIM)  # rows of a fused qkv buffer, like the models pass
    ctxs = [c for _, c in seqs]
    scale = DIM**-0.5
    nd = sum(1 for n, _ in seqs if n == 1)  # decode rows come first
    dec_slots = torch.tensor(slots[:nd])
    dec_lens = torch.tensor(ctxs[:nd])
    pf_starts = [s - nd for s in starts[nd:]]
    idx = (torch.tensor(slots), torch.tensor(starts), torch.tensor(ctxs))

    def old():
        if nd:
            decode_attention(q[:nd], k_cache, v_cache, dec_slots, dec_lens, scale)
        return _sdpa_prefill_attention(q[nd:], k_cache, v_cache, slots[nd:], pf_starts, ctxs[nd:], scale)

    def new():
        return _native_prefill_attention(q, k_cache, v_cache, *idx, scale)

    got = new()
    assert got is not None, "the native kernel is unavailable"
    ref = old()
    err = (got[nd:].float() - ref.float()).abs().max().item()
    old_t, new_t = [], []
    for _ in range(reps):
        old_t.append(_timed(old))
        new_t.append(_timed(new))
    o, n = statistics.median(old_t), statistics.median(new_t)
    return {"old_ms": o * 1e3, "new_ms": n * 1e3, "speedup": o / n, "native_gflops": _flops(seqs) / n / 1e9,
            "max_abs_diff": err}


DECODE_CASES = [(64, 300), (64, 1000), (16, 300), (16, 1000), (4, 1000)]  # (decode rows, context)
DECODE_BYTES = 1 << 30  # KV of all layers of a case (well past the LLC)


def _varlen(lib: native.NativeLibrary, dtype: torch.dtype):
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    return lib.fn(f"xllm_varlen_attention_{native.suffix(dtype)}",
                  [vp, i64, vp, vp, i64, i64, i64, i64, vp, vp, vp, i64, i64, i64, i64, i64, ctypes.c_float, vp, i64])


def _decode_case(rows: int, ctx: int, dtype: torch.dtype, reps: int, libs: dict[str, native.NativeLibrary],
                 stream: torch.Tensor) -> dict:
    """ms per layer and GB/s of K+V read per library, the stream read GB/s, interleaved (medians)."""
    gen = torch.Generator().manual_seed(2)
    per_layer = rows * ctx * KV_HEADS * DIM * 2 * dtype.itemsize
    layers = max(1, min(30, DECODE_BYTES // per_layer))
    caches = [(torch.randn(rows, ctx + 8, KV_HEADS, DIM, generator=gen).to(dtype),
               torch.randn(rows, ctx + 8, KV_HEADS, DIM, generator=gen).to(dtype)) for _ in range(layers)]
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(dtype)
    out = torch.empty(rows, HEADS, DIM, dtype=dtype)
    idx = torch.arange(rows), torch.arange(rows + 1), torch.full((rows,), ctx)
    k0 = caches[0][0]

    def run(fn) -> None:
        for k, v in caches:
            fn(qkv.data_ptr(), qkv.stride(0), k.data_ptr(), v.data_ptr(), k0.stride(0), k0.stride(1), k0.stride(0),
               k0.stride(1), idx[0].data_ptr(), idx[1].data_ptr(), idx[2].data_ptr(), rows, HEADS, KV_HEADS, DIM,
               DIM, DIM**-0.5, out.data_ptr(), out.stride(0))

    fns = {name: _varlen(lib, dtype) for name, lib in libs.items()}
    outs = {}
    for name, fn in fns.items():  # warm-up, and the outputs to compare
        run(fn)
        outs[name] = out.clone()
    times: dict[str, list[float]] = {name: [] for name in [*fns, "stream"]}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_timed(lambda fn=fn: run(fn)))
        times["stream"].append(_timed(lambda: stream.sum()))
    med = {name: statistics.median(t) for name, t in times.items()}
    kv = per_layer * layers
    res = {"layers": layers, "stream_gbs": stream.numel() * stream.itemsize / med["stream"] / 1e9}
    for name in fns:
        res[name] = {"ms_per_layer": med[name] / layers * 1e3, "gbs": kv / med[name] / 1e9}
    if len(outs) > 1:
        first, *rest = outs.values()
        res["max_abs_diff"] = max((o.float() - first.float()).abs().max().item() for o in rest)
    return res


def _decode_table(dtype: torch.dtype, reps: int, baseline: pathlib.Path | None) -> None:
    current = native.library()
    assert current is not None, "the native kernels are unavailable"
    libs = {"current": current}
    if baseline is not None:
        libs = {"baseline": native.build_from(baseline), **libs}
    stream = torch.ones(DECODE_BYTES // 2, dtype=torch.bfloat16)
    names = list(libs)
    print("| decode rows x context | layers | " + " | ".join(f"{n} ms/layer | {n} GB/s" for n in names)
          + " | stream GB/s |" + (" speedup | max abs diff |" if baseline else ""))
    print("| --- | ---: |" + " ---: | ---: |" * len(names) + " ---: |" + (" ---: | ---: |" if baseline else ""))
    for rows, ctx in DECODE_CASES:
        r = _decode_case(rows, ctx, dtype, reps, libs, stream)
        cells = " | ".join(f"{r[n]['ms_per_layer']:.3f} | {r[n]['gbs']:.1f}" for n in names)
        extra = (f" {r['baseline']['ms_per_layer'] / r['current']['ms_per_layer']:.2f}x | "
                 f"{r['max_abs_diff']:.2g} |" if baseline else "")
        print(f"| {rows} x {ctx} | {r['layers']} | {cells} | {r['stream_gbs']:.1f} |{extra}", flush=True)


def _kv_write(rows: int, dtype: torch.dtype, reps: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.zeros(8, 4096, KV_HEADS, DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(dtype)
    k = qkv[:, HEADS * DIM:(HEADS + KV_HEADS) * DIM].view(rows, KV_HEADS, DIM)
    v = qkv[:, (HEADS + KV_HEADS) * DIM:].view(rows, KV_HEADS, DIM)
    slots = torch.full((rows,), 5, dtype=torch.int64)
    positions = torch.arange(rows, dtype=torch.int64) + 100

    def old():
        k_cache[slots, positions] = k
        v_cache[slots, positions] = v

    def new():
        write_kv_rows(k_cache, v_cache, slots, positions, k, v)

    old_t, new_t = [], []
    for _ in range(reps):
        old_t.append(_timed(old))
        new_t.append(_timed(new))
    o, n = statistics.median(old_t), statistics.median(new_t)
    return {"old_ms": o * 1e3, "new_ms": n * 1e3, "speedup": o / n}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads")
    ap.add_argument("--reps", type=int, default=15, help="interleaved repetitions per case (medians reported)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="storage dtype")
    ap.add_argument("--decode", action="store_true", help="the decode-row cases (GB/s of KV read) only")
    ap.add_argument("--baseline-src", type=pathlib.Path, default=None,
                    help="with --decode: also time a library built from these kernel sources (kernels/cpu)")


def run(args: argparse.Namespace, output: Output) -> int:
    if args.baseline_src is not None and not args.decode:
        print("python -m benchmarks attention_bench: error: --baseline-src needs --decode", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.decode:
        print(f"H={HEADS} KVH={KV_HEADS} D={DIM} {args.dtype}, {args.threads} threads, {args.reps} reps (medians)\n")
        _decode_table(dtype, args.reps, args.baseline_src)
        return 0
    print(f"H={HEADS} KVH={KV_HEADS} D={DIM} {args.dtype}, {args.threads} threads, {args.reps} reps (medians)\n")
    print("| case | SDPA path (ms) | native varlen (ms) | speedup | native GFLOP/s | max abs diff |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, seqs in CASES:
        r = _case(seqs, dtype, args.reps)
        print(f"| {name} | {r['old_ms']:.3f} | {r['new_ms']:.3f} | {r['speedup']:.1f}x | "
              f"{r['native_gflops']:.0f} | {r['max_abs_diff']:.2g} |", flush=True)
    print("\n| KV write (K+V rows) | index_put (ms) | write_kv_rows (ms) | speedup |")
    print("| --- | ---: | ---: | ---: |")
    for rows in (128, 2048):
        r = _kv_write(rows, dtype, args.reps)
        print(f"| {rows} rows | {r['old_ms']:.3f} | {r['new_ms']:.3f} | {r['speedup']:.1f}x |", flush=True)
    return 0



SCENARIO = Scenario("attention_bench", "prefill attention: per-chunk SDPA vs the native varlen kernel; decode rows",
                    __doc__, add_arguments, run)
