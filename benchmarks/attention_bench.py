"""Prefill attention: the per-chunk torch SDPA path vs the native varlen kernel (one call per step).

SmolLM2-135M shapes by default (9 query heads, 3 KV heads, head_dim 64, bf16) over a slot-addressed
cache. Cases: one fresh chunk of 128/512/2048 tokens, a 256-token chunk after a 1024-token prefix,
16 fresh chunks of 128, and a mixed step of 15 decode rows + one 128-token chunk (old: the native
decode kernel for the decode rows plus SDPA for the chunk, as ``SlotAttention`` ran them; new: one
varlen call for all rows). Also the prefill KV write: ``k_cache[slots, positions] = k`` (index_put)
vs ``write_kv_rows``. Old and new run interleaved; medians per case.

    python -m benchmarks.attention_bench [--threads 2] [--reps 15] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads")
    ap.add_argument("--reps", type=int, default=15, help="interleaved repetitions per case (medians reported)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="storage dtype")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
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


if __name__ == "__main__":
    raise SystemExit(main())
