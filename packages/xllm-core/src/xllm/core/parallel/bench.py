"""Micro-benchmark of the all-reduce of a step's activations: the shared-memory group (:class:`ShmComm`) against
gloo over loopback TCP (:class:`GlooComm`), two ranks on this host (this process and one spawned peer).
Used by ``python -m benchmarks parallel``; not a test (timings on a shared machine are noisy)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from xllm.common.net import free_port
from xllm.core.parallel.comm import Communicator, GlooComm, GroupAddress
from xllm.core.parallel.shm import ShmComm

DEFAULT_SIZES: tuple[tuple[int, int], ...] = ((1, 576), (16, 576), (64, 576), (512, 576))
_WARMUP = 20


def _time_sizes(comm: Communicator, sizes: Sequence[tuple[int, int]], iters: int) -> list[tuple[float, float]]:
    """(p50, p90) microseconds of one in-place bf16 all-reduce of each size, over ``iters`` calls timed one
    by one (a barrier first, so both ranks start together); every rank runs the same sequence."""
    out = []
    for rows, cols in sizes:
        x = torch.randn(rows, cols).bfloat16()
        for _ in range(_WARMUP):
            comm.all_reduce(x.zero_())
        comm.barrier()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            comm.all_reduce(x)
            times.append((time.perf_counter() - start) * 1e6)
        times.sort()
        out.append((times[len(times) // 2], times[min(len(times) - 1, len(times) * 9 // 10)]))
    return out


def _peer(name: str | None, port: int, sizes: list[tuple[int, int]], iters: int) -> None:
    """Rank 1: the same sequence of collectives as rank 0 (no shared-memory part where ``name`` is None)."""
    if name is not None:
        shm = ShmComm.attach(name, 1, 2, timeout_s=120)
        try:
            _time_sizes(shm, sizes, iters)
        finally:
            shm.close()
    gloo = GlooComm(GroupAddress("127.0.0.1", port, timeout_s=120), 1, 2)
    try:
        _time_sizes(gloo, sizes, iters)
    finally:
        gloo.close()


def allreduce_latencies(sizes: Sequence[tuple[int, int]] = DEFAULT_SIZES, iters: int = 200) -> dict:
    """Microseconds per in-place bf16 all-reduce of each ``[rows, hidden]`` in ``sizes`` between two ranks
    (this process and a spawned peer): ``{"ranks": 2, "dtype": "bfloat16", "iters": iters, "rows": [{"rows",
    "hidden", "shm_us_p50", "shm_us_p90", "gloo_us_p50", "gloo_us_p90"}, ...]}`` (the shm values None where
    the native library is unavailable). This process must not be in a ``torch.distributed`` group already
    (gloo uses the default group)."""
    import torch.multiprocessing as mp

    sizes = [(int(r), int(c)) for r, c in sizes]
    port = free_port()
    shm, name = ShmComm.create(2, timeout_s=120) if ShmComm.available() else (None, None)
    peer = mp.get_context("spawn").Process(target=_peer, args=(name, port, sizes, iters), daemon=True)
    peer.start()
    shm_t: list = [(None, None)] * len(sizes)
    try:
        if shm is not None:
            try:
                shm_t = _time_sizes(shm, sizes, iters)
            finally:
                shm.close()
        gloo = GlooComm(GroupAddress("127.0.0.1", port, timeout_s=120), 0, 2)
        try:
            gloo_t = _time_sizes(gloo, sizes, iters)
        finally:
            gloo.close()
    finally:
        peer.join(60)
        if peer.is_alive():
            peer.kill()
            peer.join(5)
    rows = [{"rows": r, "hidden": c, "shm_us_p50": s[0], "shm_us_p90": s[1], "gloo_us_p50": g[0],
             "gloo_us_p90": g[1]} for (r, c), s, g in zip(sizes, shm_t, gloo_t, strict=True)]
    return {"ranks": 2, "dtype": "bfloat16", "iters": iters, "rows": rows}
