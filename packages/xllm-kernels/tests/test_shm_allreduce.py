"""The shared-memory collectives (kernels/cpu/shm_allreduce.c through xllm.core.parallel.shm.ShmComm): sums
equal to the fp32 sum in rank order (bit for bit, every rank the same), pieces larger than the buffer,
all_gather, barrier, and failures that raise CollectiveError within the timeout instead of hanging."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from xllm.core.parallel import CollectiveError
from xllm.core.parallel.shm import ShmComm
from xllm.kernels import native, shm_allreduce

pytestmark = pytest.mark.skipif(not ShmComm.available(), reason="native library unavailable")

BUF = 4096  # bytes per rank buffer: the larger cases go in several pieces


def _inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        torch.randn(16, 576, generator=g),  # f32, 9 pieces
        torch.randn(1, 576, generator=g).bfloat16(),  # one piece
        torch.randn(37, 333, generator=g).bfloat16(),  # bf16 in 7 pieces, the last partial
        torch.randn(5, 7, generator=g),  # smaller than a piece
        torch.randn(24, 40, generator=g).t(),  # non-contiguous: reduced through a copy
        torch.randn(100, generator=g).half(),  # float16: through a float32 copy
    ]


def _reference(size: int) -> list[torch.Tensor]:
    """fp32 sums in rank order, rounded once to the dtype (the C contract)."""
    per_rank = [_inputs(r) for r in range(size)]
    out = []
    for i, x0 in enumerate(per_rank[0]):
        acc = x0.float().clone()
        for r in range(1, size):
            acc += per_rank[r][i].float()
        out.append(acc.to(x0.dtype))
    return out


def _exercise(comm: ShmComm) -> list[str]:
    """Every collective on this rank; the failures found (the same checks on every rank)."""
    bad = []
    expected = _reference(comm.size)
    for i, x in enumerate(_inputs(comm.rank)):
        y = comm.all_reduce(x)
        if y is not x or not torch.equal(x, expected[i]):
            bad.append(f"all_reduce case {i} ({x.dtype}, {tuple(x.shape)}): max diff "
                       f"{(x.float() - expected[i].float()).abs().max().item()}")
    mine = torch.arange(3000, dtype=torch.int64) * (comm.rank + 1)  # 24000 bytes: 6 pieces
    got = comm.all_gather(mine)
    if len(got) != comm.size or any(not torch.equal(t, torch.arange(3000) * (r + 1)) for r, t in enumerate(got)):
        bad.append("all_gather")
    comm.barrier()
    return bad


def _child(name: str, rank: int, size: int, out) -> None:
    torch.set_num_threads(1)
    comm = ShmComm.attach(name, rank, size, timeout_s=120)
    try:
        out.put((rank, _exercise(comm)))
    except Exception as e:  # reported, not swallowed: the parent asserts on it
        out.put((rank, [repr(e)]))
    finally:
        comm.close()


def test_three_processes_sum_gather_and_barrier():
    size = 3
    comm, name = ShmComm.create(size, max_bytes=BUF, timeout_s=120)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(name, r, size, out)) for r in range(1, size)]
    for p in procs:
        p.start()
    try:
        assert _exercise(comm) == []
        results = dict(out.get(timeout=120) for _ in procs)
        assert results == {r: [] for r in range(1, size)}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        comm.close()


def _in_threads(comms: list[ShmComm], fn) -> list:
    """fn(comm) on every rank at once, one thread each (the C calls release the GIL)."""
    results: list = [None] * len(comms)

    def run(i: int) -> None:
        try:
            results[i] = fn(comms[i])
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return results


def _group(size: int, timeout_s: float, max_bytes: int = BUF) -> list[ShmComm]:
    first, name = ShmComm.create(size, max_bytes=max_bytes, timeout_s=timeout_s)
    return [first] + [ShmComm.attach(name, r, size, timeout_s=timeout_s) for r in range(1, size)]


def test_four_ranks_agree_bit_for_bit():
    comms = _group(4, timeout_s=30)
    try:
        assert _in_threads(comms, _exercise) == [[], [], [], []]
        # many small collectives in a row: the two buffer sets alternate without a rank overtaking another
        sums = _in_threads(comms, lambda c: [c.all_reduce(torch.full((64,), float(c.rank + k))).clone()
                                             for k in range(200)])
        for k in range(200):
            assert all(torch.equal(s[k], torch.full((64,), 6.0 + 4 * k)) for s in sums)
    finally:
        for c in comms:
            c.close()


def test_a_rank_that_never_arrives_raises_within_the_timeout():
    comms = _group(3, timeout_s=0.5)
    try:
        start = time.monotonic()
        res = _in_threads(comms[:2], lambda c: c.all_reduce(torch.ones(8)))  # rank 2 never calls
        elapsed = time.monotonic() - start
        assert all(isinstance(e, CollectiveError) for e in res), res
        assert "2]" in str(res[0]) and "timed out" in str(res[0])
        assert elapsed < 5
        with pytest.raises(CollectiveError, match="earlier collective"):  # the group is unusable afterwards
            comms[0].barrier()
    finally:
        for c in comms:
            c.close()


def _attach_and_exit(name: str) -> None:
    ShmComm.attach(name, 1, 2, timeout_s=60)  # never closed: the process just ends


def test_a_rank_whose_process_died_is_named_before_the_timeout():
    comm, name = ShmComm.create(2, max_bytes=BUF, timeout_s=60)
    try:
        p = mp.get_context("spawn").Process(target=_attach_and_exit, args=(name,))
        p.start()
        p.join(120)
        assert p.exitcode == 0
        start = time.monotonic()
        with pytest.raises(CollectiveError, match=r"exited \[1\]"):
            comm.all_reduce(torch.ones(4, dtype=torch.bfloat16))
        assert time.monotonic() - start < 10  # far below the 60 s timeout
    finally:
        comm.close()


def test_the_segment_is_gone_after_close():
    comms = _group(2, timeout_s=0.3)
    path = f"/dev/shm{comms[0].name}"
    assert os.path.exists(path)
    handle = comms[0].native_handle()
    assert handle
    for c in comms:
        c.close()
        c.close()  # idempotent
    assert not os.path.exists(path)
    with pytest.raises(CollectiveError, match="closed"):
        comms[0].all_reduce(torch.ones(2))
    with pytest.raises(CollectiveError, match=r"cannot attach .* \(absent after 0.2s\)"):
        ShmComm.attach(comms[0].name, 1, 2, timeout_s=0.2)


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="size"):
        ShmComm.create(0)
    comms = _group(2, timeout_s=0.3)
    try:
        with pytest.raises(TypeError, match="int64"):
            comms[0].all_reduce(torch.ones(2, dtype=torch.int64))
        with pytest.raises(CollectiveError, match="made for another group size"):
            ShmComm.attach(comms[0].name, 1, 3, timeout_s=0.2)
    finally:
        for c in comms:
            c.close()


def test_unavailable_without_the_native_library(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    monkeypatch.setattr(native, "avx2_library", lambda: None)
    assert not ShmComm.available()
    with pytest.raises(CollectiveError, match="GlooComm"):
        ShmComm.create(2)


def test_the_avx2_library_carries_the_collectives_too():
    lib = native.avx2_library()
    if lib is None:
        pytest.skip(native.avx2_unavailable_reason())
    cdll = shm_allreduce._bind(str(lib.path))
    first = shm_allreduce.ShmGroup(cdll, cdll.xllm_shm_create(b"/xllm-test-avx2-%d" % os.getpid(), 2, 256, 5.0),
                                   0, 2, "")
    second = shm_allreduce.ShmGroup(cdll, cdll.xllm_shm_attach(b"/xllm-test-avx2-%d" % os.getpid(), 1, 2, 5.0),
                                    1, 2, "")
    try:
        xs = [torch.arange(300, dtype=torch.float32) * (r + 1) for r in range(2)]
        _in_threads([first, second], lambda g: g.all_reduce(xs[g.rank]))
        assert all(torch.equal(x, torch.arange(300, dtype=torch.float32) * 3) for x in xs)
    finally:
        first.close()
        second.close()
