"""The worker ranks of a tensor-parallel engine instance (``--tensor-parallel-size N``): starting them, and
each one's process.

:func:`start_ranks` (rank 0, the engine process, before it loads its own shard) creates the step-plan
channel and the collectives' group, spawns ranks ``1..N-1`` (the ``spawn`` start method: no forked
OpenMP or torch state) and joins the group; it returns the
:class:`~xllm.core.executor.group.RankGroup` the engine is built with. Each worker (:func:`rank_main`)
sets its torch threads, joins the group, loads its shard of the model (``load_model(..., tp_rank=r,
tp_size=N, comm=...)``; a GGUF as the loader does for rank 0) and runs
:func:`~xllm.core.executor.worker.serve_rank` until rank 0 shuts it down or dies.

The collectives: the native shared-memory all-reduce (:mod:`xllm.core.parallel.shm`) where it is built
and available, else ``torch.distributed`` over gloo on a free loopback port.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pathlib
import socket
import sys
from dataclasses import dataclass

import torch

from xllm.core.config import EngineConfig
from xllm.core.engine_build import default_rank_threads
from xllm.core.executor import ChannelSpec, PlanChannel, RankGroup, parent_alive, serve_rank
from xllm.core.parallel.comm import Communicator, GlooComm, GroupAddress
from xllm.engine_api.errors import ConfigError

log = logging.getLogger(__name__)

PLAN_SLOT_MIN_BYTES = 2 << 20


@dataclass(frozen=True)
class CommSpec:
    """How a rank joins its group's collectives: ``kind`` ``"shm"`` (the segment ``name``) or ``"gloo"``
    (rank 0's store at ``address``)."""

    kind: str
    timeout_s: float
    name: str | None = None
    address: GroupAddress | None = None


@dataclass(frozen=True)
class RankSpec:
    """What worker ``rank`` of ``size`` is started with (picklable: it travels to the spawned process)."""

    rank: int
    size: int
    model_dir: str
    dtype: torch.dtype
    quantization: str
    gguf_file: str | None
    threads: int
    device: str
    parent_pid: int
    channel: ChannelSpec
    comm: CommSpec
    log_level: int = logging.INFO  # rank 0's


def join_comm(spec: CommSpec, rank: int, size: int) -> Communicator:
    """This rank's communicator of the group ``spec`` names."""
    if spec.kind == "shm":
        from xllm.core.parallel.shm import ShmComm
        return ShmComm.attach(spec.name, rank, size, spec.timeout_s)
    return GlooComm(spec.address, rank, size)


def model_kwargs(rank: int, size: int, comm: Communicator) -> dict:
    """``load_model``'s tensor-parallel arguments for ``rank`` of ``size``."""
    return {} if size == 1 else {"tp_rank": rank, "tp_size": size, "comm": comm}


def rank_main(spec: RankSpec) -> None:
    """A worker rank's process: join, load the shard, serve steps until shut down (exit status 0) or
    until rank 0 dies or a step fails (status 1, the cause logged)."""
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s rank {spec.rank} %(levelname)s %(name)s: "
                                                   "%(message)s", stream=sys.stderr)
    from xllm.models import load_model

    torch.set_num_threads(spec.threads)
    channel = PlanChannel.attach(spec.channel, spec.rank)
    comm = None
    try:
        comm = join_comm(spec.comm, spec.rank, spec.size)
        model = load_model(spec.model_dir, spec.dtype, device=spec.device, progress=False,
                           quantization=spec.quantization, gguf_file=spec.gguf_file,
                           **model_kwargs(spec.rank, spec.size, comm))
        steps = serve_rank(model, comm, channel, torch.device(spec.device), parent_alive(spec.parent_pid))
        log.info("rank %d of %d stopped after %d steps", spec.rank, spec.size, steps)
    except BaseException:
        log.exception("rank %d of %d failed", spec.rank, spec.size)
        raise SystemExit(1) from None
    finally:
        if comm is not None:
            comm.close()
        channel.close()


def plan_slot_bytes(cfg: EngineConfig) -> int:
    """A step plan's largest message for ``cfg`` (rows, per-sequence fields, block tables), at least 2 MiB."""
    rows = cfg.max_num_batched_tokens + cfg.max_num_seqs * (cfg.num_speculative_tokens + 1)
    tables = cfg.max_num_seqs * -(-(cfg.max_model_len or 32768) // (cfg.block_size or 16))
    return max(PLAN_SLOT_MIN_BYTES, 8 * (64 + 6 * rows + 8 * cfg.max_num_seqs + tables))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _comm_spec(size: int, kind: str, timeout_s: float):
    """Rank 0's communicator (created; None for gloo, joined once the workers started) and the spec the
    workers join it by. ``kind``: ``--tp-comm`` (``auto``: shm where the native kernels are built)."""
    from xllm.core.parallel.shm import ShmComm

    if kind == "shm" and not ShmComm.available():
        raise ConfigError("--tp-comm shm needs the native kernels (a C compiler; XLLM_NATIVE not 0)")
    if kind != "gloo" and ShmComm.available():  # (tensors beyond its buffer go in pieces)
        comm, name = ShmComm.create(size, timeout_s=timeout_s)
        return comm, CommSpec("shm", timeout_s, name=name)
    return None, CommSpec("gloo", timeout_s, address=GroupAddress("127.0.0.1", _free_port(), timeout_s))


def start_ranks(model_dir: pathlib.Path, cfg: EngineConfig, gguf: pathlib.Path | None,
                timeout_s: float = 60.0) -> RankGroup:
    """Spawn ranks ``1..N-1`` of ``cfg.tensor_parallel_size`` for ``model_dir`` and join their group as
    rank 0 (the caller loads rank 0's shard with ``model_kwargs(0, N, group.comm)`` and builds the engine
    with the group, which stops the workers when it closes)."""
    size = cfg.tensor_parallel_size
    ctx = multiprocessing.get_context("spawn")
    channel = PlanChannel.create(size, plan_slot_bytes(cfg), context=ctx)
    comm = None
    processes: list = []
    try:
        comm, comm_spec = _comm_spec(size, cfg.tp_comm, timeout_s)
        threads = cfg.num_threads or default_rank_threads(size) or 1
        for rank in range(1, size):
            spec = RankSpec(rank, size, str(model_dir), cfg.dtype, cfg.quantization,
                            None if gguf is None else str(gguf), threads, cfg.device, os.getpid(), channel.spec,
                            comm_spec, logging.getLogger().getEffectiveLevel())
            p = ctx.Process(target=rank_main, args=(spec,), name=f"xllm-rank-{rank}", daemon=True)
            p.start()
            processes.append(p)
        if comm is None:
            comm = join_comm(comm_spec, 0, size)
        log.info("tensor parallelism: %d ranks (%s collectives, %d threads per worker rank), worker pids %s",
                 size, comm_spec.kind, threads, [p.pid for p in processes])
        return RankGroup(comm, channel, processes, timeout_s=timeout_s)
    except BaseException:
        for p in processes:
            p.kill()
            p.join(5)
        if comm is not None:
            comm.close()
        channel.close()
        raise
