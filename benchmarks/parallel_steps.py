"""How a tensor-parallel step's time splits between compute and communication, with and without overlap
(xLLM §4.1 "dual-stream", :mod:`xllm.core.overlap`): two ranks on this host (this process and one spawned
peer) each load their shard of a model and run the eager forward of a few step shapes, plain (one forward,
each all-reduce blocking) and overlapped (two micro-batches by whole sequences, one's all-reduce in flight
while the other computes), over the native shared-memory all-reduce and over gloo.

Per comm and shape: the median step time each way and the all-reduce's share of the step, the time this
rank spent blocked in collectives (an all-reduce call; overlapped: starting one and waiting for it) over
the step time; overlapped, that is the communication left exposed. The attention is packed causal attention
over each sequence's rows of the step alone (no KV cache: a decode row attends to itself), so the shapes
weigh the linears and the collectives as a short-context step does. The fused native steps (which take the
shm all-reduce inside C) are not timed here: a communicator wrapped for timing sends the shard eager.
Used by ``python -m benchmarks parallel``; not a test (timings on a shared machine are noisy).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from xllm.common.net import free_port
from xllm.core.overlap import MicroBatch
from xllm.core.parallel.comm import Communicator, GlooComm, GroupAddress, PendingReduce
from xllm.core.parallel.shm import ShmComm

#: name -> rows of each sequence of the step (decode rows are sequences of one row)
DEFAULT_SHAPES: dict[str, tuple[int, ...]] = {
    "decode 16": (1,) * 16, "decode 64": (1,) * 64, "prefill 4x128": (128,) * 4,
    "15 decodes + 256 chunk": (*(1,) * 15, 256),
}


@dataclass
class TimedComm:
    """``inner`` with the time this thread spends blocked in its collectives summed in ``blocked_s``."""

    inner: Communicator
    blocked_s: float = 0.0
    rank: int = field(init=False)
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.rank, self.size = self.inner.rank, self.inner.size

    def _timed(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.blocked_s += time.perf_counter() - start

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._timed(self.inner.all_reduce, x)

    def all_reduce_start(self, x: torch.Tensor) -> PendingReduce:
        return _TimedPending(self, self._timed(self.inner.all_reduce_start, x))

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self._timed(self.inner.all_gather, x)

    def barrier(self) -> None:
        self.inner.barrier()

    def close(self) -> None:
        self.inner.close()


@dataclass
class _TimedPending:
    comm: TimedComm
    pending: PendingReduce

    def wait(self) -> torch.Tensor:
        return self.comm._timed(self.pending.wait)


@dataclass
class PackedCausal:
    """Causal attention over each sequence's rows alone (``lens``: rows per sequence, in row order)."""

    lens: list[int]

    def attention(self, layer, q, k, v, scale, v_dim=None):
        rep = q.shape[1] // k.shape[1]
        outs = []
        for qs, ks, vs in zip(q.split(self.lens), k.split(self.lens), v.split(self.lens), strict=True):
            ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
            o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                               is_causal=True, scale=scale)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)


def micro_batches(lens: Sequence[int], vocab: int) -> tuple[MicroBatch, list[MicroBatch]]:
    """A step of sequences of ``lens`` rows (random ids, positions from 0) whole and in two parts by whole
    sequences, the rows as even as the sequences allow."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    total, best = sum(lens), 1
    for s in range(1, len(lens)):
        if abs(2 * sum(lens[:s]) - total) < abs(2 * sum(lens[:best]) - total):
            best = s
    cut = sum(lens[:best])
    whole = MicroBatch(ids, pos, PackedCausal(list(lens)))
    return whole, [MicroBatch(ids[:cut], pos[:cut], PackedCausal(list(lens[:best]))),
                   MicroBatch(ids[cut:], pos[cut:], PackedCausal(list(lens[best:])))]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


@torch.inference_mode()
def time_shapes(model, comm: TimedComm, shapes: dict[str, tuple[int, ...]], iters: int, warmup: int) -> list[dict]:
    """Per shape: median step ms and all-reduce share, plain and overlapped (alternating, a barrier before each
    step so that the ranks start together); every rank runs the same sequence of collectives."""
    out = []
    for name, lens in shapes.items():
        whole, parts = micro_batches(lens, model.vocab_size)
        runs: dict[str, list[tuple[float, float]]] = {"plain": [], "overlap": []}
        for i in range(warmup + iters):
            for way in ("plain", "overlap"):
                comm.barrier()
                comm.blocked_s = 0.0
                start = time.perf_counter()
                if way == "plain":
                    hidden = model.forward(whole.input_ids, whole.positions, whole.ctx)
                else:
                    hidden = model.forward_overlapped(parts)
                model.compute_greedy(hidden[-1:])
                step = time.perf_counter() - start
                if i >= warmup:
                    runs[way].append((step, comm.blocked_s / step))
        row: dict = {"shape": name, "rows": sum(lens), "sequences": len(lens)}
        for way, samples in runs.items():
            row[f"{way}_ms"] = _median([s for s, _ in samples]) * 1e3
            row[f"{way}_comm_share"] = _median([c for _, c in samples])
        row["speedup"] = row["plain_ms"] / row["overlap_ms"]
        out.append(row)
    return out


def _rank(rank: int, model_dir: str, dtype: torch.dtype, comm: Communicator, threads: int,
          shapes: dict[str, tuple[int, ...]], iters: int, warmup: int) -> list[dict]:
    from xllm.models import load_model

    torch.set_num_threads(threads)
    timed = TimedComm(comm)
    model = load_model(model_dir, dtype, progress=False, tp_rank=rank, tp_size=2, comm=timed)
    return time_shapes(model, timed, shapes, iters, warmup)


def _peer(name: str | None, port: int, model_dir: str, dtype: torch.dtype, threads: int,
          shapes: dict[str, tuple[int, ...]], iters: int, warmup: int) -> None:
    """Rank 1: the same sequence as rank 0 (no shared-memory part where ``name`` is None)."""
    if name is not None:
        shm = ShmComm.attach(name, 1, 2, timeout_s=300)
        try:
            _rank(1, model_dir, dtype, shm, threads, shapes, iters, warmup)
        finally:
            shm.close()
    gloo = GlooComm(GroupAddress("127.0.0.1", port, timeout_s=300), 1, 2)
    try:
        _rank(1, model_dir, dtype, gloo, threads, shapes, iters, warmup)
    finally:
        gloo.close()


def step_split(model_dir: str, dtype: torch.dtype = torch.bfloat16, threads: int = 1,
               shapes: dict[str, tuple[int, ...]] | None = None, iters: int = 20, warmup: int = 3) -> dict:
    """Two ranks of ``model_dir`` (``threads`` each): ``{"ranks": 2, "dtype", "threads", "iters", "rows": [{"comm",
    "shape", "rows", "sequences", "plain_ms", "overlap_ms", "plain_comm_share", "overlap_comm_share", "speedup"},
    ...]}`` (no shm rows where the native library is unavailable). This process must not be in a
    ``torch.distributed`` group already (gloo uses the default group)."""
    import torch.multiprocessing as mp

    shapes = dict(shapes or DEFAULT_SHAPES)
    port = free_port()
    shm, name = ShmComm.create(2, timeout_s=300) if ShmComm.available() else (None, None)
    args = (name, port, str(model_dir), dtype, threads, shapes, iters, warmup)
    peer = mp.get_context("spawn").Process(target=_peer, args=args, daemon=True)
    peer.start()
    rows: list[dict] = []
    saved = torch.get_num_threads()
    try:
        if shm is not None:
            try:
                rows += [{"comm": "shm", **r} for r in _rank(0, str(model_dir), dtype, shm, threads, shapes, iters,
                                                              warmup)]
            finally:
                shm.close()
        gloo = GlooComm(GroupAddress("127.0.0.1", port, timeout_s=300), 0, 2)
        try:
            rows += [{"comm": "gloo", **r} for r in _rank(0, str(model_dir), dtype, gloo, threads, shapes, iters,
                                                           warmup)]
        finally:
            gloo.close()
    finally:
        torch.set_num_threads(saved)
        peer.join(60)
        if peer.is_alive():
            peer.kill()
            peer.join(5)
    return {"ranks": 2, "dtype": str(dtype).removeprefix("torch."), "threads": threads, "iters": iters,
            "rows": rows}
