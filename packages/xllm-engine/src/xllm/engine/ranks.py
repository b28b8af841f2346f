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
and available, else ``torch.distributed`` over gloo on a free loopback port (or ``--master-addr`` /
``--master-port``). With ranks on several hosts (``--nnodes H``, :mod:`xllm.engine.nodes`) every rank uses
gloo at ``--master-addr:--master-port`` for both the collectives and the step plans
(:class:`~xllm.core.executor.net_channel.NetPlanChannel`; shared memory between the ranks of one host is
not used yet). Trust (:mod:`xllm.core.parallel.trust`): a rendezvous beyond loopback needs the cluster
token, and right after it every rank proves the token to every other, before any weight or plan moves.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pathlib
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.context import BaseContext

import torch

from xllm.common.net import free_port
from xllm.core.config import EngineConfig
from xllm.core.engine_build import default_rank_threads
from xllm.core.executor import ChannelSpec, PlanChannel, RankGroup, parent_alive, serve_rank
from xllm.core.executor.channel import StepChannel
from xllm.core.executor.net_channel import NetChannelSpec, NetPlanChannel
from xllm.core.parallel.comm import Communicator, GlooComm, GroupAddress
from xllm.core.parallel.trust import check_group_address, prove_group
from xllm.engine_api import logs
from xllm.engine_api.credential import ClusterKeys
from xllm.engine_api.errors import ConfigError
from xllm.engine_api.security import is_loopback

log = logging.getLogger(__name__)

PLAN_SLOT_MIN_BYTES = 2 << 20
# how long a worker of an instance over several hosts waits for the next step plan (the network plan channel's
# group timeout): an instance idle longer than this loses its ranks
IDLE_TIMEOUT_S = 7 * 24 * 3600.0


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
    channel: ChannelSpec | NetChannelSpec
    comm: CommSpec
    log_level: int = logging.INFO  # rank 0's
    log_format: str = "text"  # rank 0's (xllm.engine_api.logs)
    keys: ClusterKeys | None = None  # the cluster token's, proved to the other ranks (never shown)
    expert_parallel: bool = False  # --enable-expert-parallel (xllm.models.expert_parallel)
    redundant_experts: int = 0  # --num-redundant-experts


def join_comm(spec: CommSpec, rank: int, size: int) -> Communicator:
    """This rank's communicator of the group ``spec`` names."""
    if spec.kind == "shm":
        from xllm.core.parallel.shm import ShmComm
        return ShmComm.attach(spec.name, rank, size, spec.timeout_s)
    return GlooComm(spec.address, rank, size)


def join_group(channel: ChannelSpec | NetChannelSpec, comm_spec: CommSpec, rank: int, size: int,
               keys: ClusterKeys | None) -> tuple[StepChannel, Communicator]:
    """Worker ``rank``'s plan channel and communicator: join the collectives, prove the cluster token
    (:func:`~xllm.core.parallel.trust.prove_group`: collective, before anything else flows), then take the
    channel (a network channel's group is made now, collectively, as rank 0 does in :func:`start_ranks`)."""
    with gloo_interface(comm_spec):
        comm = join_comm(comm_spec, rank, size)
        try:
            prove_group(comm, keys)
            if isinstance(channel, NetChannelSpec):
                return NetPlanChannel.join(channel), comm
            return PlanChannel.attach(channel, rank), comm
        except BaseException:
            comm.close()
            raise


@contextlib.contextmanager
def gloo_interface(spec: CommSpec) -> Iterator[None]:
    """While it lasts, the gloo groups this process makes use the interface this host reaches rank 0's
    rendezvous by (``$GLOO_SOCKET_IFNAME``, restored after), unless ``$GLOO_SOCKET_IFNAME`` names one already:
    gloo otherwise binds the address the host name resolves to, which another host may not reach (or
    loopback). Nothing for shm or a loopback rendezvous."""
    name = None
    if spec.kind == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME") and not is_loopback(spec.address.host):
        name = route_interface(spec.address.host)
    if name is None:
        yield
        return
    log.info("gloo binds interface %s (the route to %s)", name, spec.address.host)
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def route_interface(host: str) -> str | None:
    """The name of the interface whose address this host reaches ``host`` from (Linux; None if unknown)."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet: picks the route and its source address
            local = s.getsockname()[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    req = struct.pack("256s", name.encode()[:15])
                    addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
                except OSError:
                    continue
                if addr == local:
                    return name
    except OSError:
        return None
    return None


def model_kwargs(rank: int, size: int, comm: Communicator, expert_parallel: bool = False,
                 redundant_experts: int = 0) -> dict:
    """``load_model``'s tensor-parallel (and expert-parallel) arguments for ``rank`` of ``size``."""
    if size == 1:
        return {}
    ep = {"expert_parallel": True, "redundant_experts": redundant_experts} if expert_parallel else {}
    return {"tp_rank": rank, "tp_size": size, "comm": comm, **ep}


def rank_main(spec: RankSpec) -> None:
    """A worker rank's process: join, load the shard, serve steps until shut down (exit status 0) or
    until rank 0 dies or a step fails (status 1, the cause logged)."""
    logs.setup_logging(spec.log_level, spec.log_format, {"rank": spec.rank},
                       f"%(asctime)s rank {spec.rank} %(levelname)s %(name)s%(request_tag)s: %(message)s")
    # a worker leaves on rank 0's SHUTDOWN or with rank 0: a SIGTERM or Ctrl-C to the whole process group (a
    # supervisor, systemd's control group, a terminal) must not kill it under rank 0's graceful drain
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    from xllm.models import load_model

    torch.set_num_threads(spec.threads)
    channel = comm = None
    try:
        channel, comm = join_group(spec.channel, spec.comm, spec.rank, spec.size, spec.keys)
        model = load_model(spec.model_dir, spec.dtype, device=spec.device, progress=False,
                           quantization=spec.quantization, gguf_file=spec.gguf_file,
                           **model_kwargs(spec.rank, spec.size, comm, spec.expert_parallel,
                                          spec.redundant_experts))
        steps = serve_rank(model, comm, channel, torch.device(spec.device),  # type: ignore[arg-type]
                           parent_alive(spec.parent_pid))
        log.info("rank %d of %d stopped after %d steps", spec.rank, spec.size, steps)
    except BaseException:
        log.exception("rank %d of %d failed", spec.rank, spec.size)
        raise SystemExit(1) from None
    finally:
        if channel is not None:
            channel.close()
        if comm is not None:
            comm.close()


def plan_slot_bytes(cfg: EngineConfig) -> int:
    """A step plan's largest message for ``cfg`` (rows, per-sequence fields, block tables), at least 2 MiB."""
    rows = cfg.max_num_batched_tokens + cfg.max_num_seqs * (cfg.num_speculative_tokens + 1)
    tables = cfg.max_num_seqs * -(-(cfg.max_model_len or 32768) // (cfg.block_size or 16))
    return max(PLAN_SLOT_MIN_BYTES, 8 * (64 + 6 * rows + 8 * cfg.max_num_seqs + tables))


def gloo_spec(cfg: EngineConfig, timeout_s: float) -> CommSpec:
    """The gloo group at ``--master-addr:--master-port`` (a free port when none is given: one host), after
    :func:`~xllm.core.parallel.trust.check_group_address` (beyond loopback only with the cluster token)."""
    check_group_address(cfg.master_addr, cfg.cluster_keys)
    port = cfg.master_port or free_port(cfg.master_addr)
    return CommSpec("gloo", timeout_s, address=GroupAddress(cfg.master_addr, port, timeout_s))


def _comm_spec(cfg: EngineConfig, timeout_s: float):
    """Rank 0's communicator on one host (created; None for gloo, joined once the workers started) and the
    spec the workers join it by. ``cfg.tp_comm``: ``--tp-comm`` (``auto``: shm where the native kernels are
    built)."""
    from xllm.core.parallel.shm import ShmComm

    kind = cfg.tp_comm
    if kind == "shm" and not ShmComm.available():
        raise ConfigError("--tp-comm shm needs the native kernels (a C compiler; XLLM_NATIVE not 0)")
    if kind != "gloo" and ShmComm.available():  # (tensors beyond its buffer go in pieces)
        comm, name = ShmComm.create(cfg.tensor_parallel_size, timeout_s=timeout_s)
        return comm, CommSpec("shm", timeout_s, name=name)
    return None, gloo_spec(cfg, timeout_s)


def node_ranks(cfg: EngineConfig) -> range:
    """The ranks node ``cfg.node_rank`` of ``cfg.nnodes`` holds (``N/H`` consecutive ones)."""
    local = cfg.tensor_parallel_size // cfg.nnodes
    return range(cfg.node_rank * local, (cfg.node_rank + 1) * local)


def spawn_ranks(ranks: range, model_dir: pathlib.Path, cfg: EngineConfig, gguf: pathlib.Path | None,
                channel: ChannelSpec | NetChannelSpec, comm: CommSpec, ctx: BaseContext) -> list:
    """Start worker ``ranks`` of ``cfg.tensor_parallel_size`` (each :func:`rank_main`, a daemon child of this
    process, ``--threads`` each: by default this host's cores divided by its ranks); their processes."""
    threads = cfg.num_threads or default_rank_threads(cfg.tensor_parallel_size // cfg.nnodes) or 1
    processes = []
    try:
        for rank in ranks:
            spec = RankSpec(rank, cfg.tensor_parallel_size, str(model_dir), cfg.dtype, cfg.quantization,
                            None if gguf is None else str(gguf), threads, cfg.device, os.getpid(), channel, comm,
                            logging.getLogger().getEffectiveLevel(), logs.current_format(), cfg.cluster_keys,
                            cfg.enable_expert_parallel, cfg.num_redundant_experts)
            p = ctx.Process(target=rank_main, args=(spec,), name=f"xllm-rank-{rank}", daemon=True)
            p.start()
            processes.append(p)
    except BaseException:
        stop_processes(processes)
        raise
    return processes


def stop_processes(processes: list, timeout_s: float = 5.0) -> None:
    """Kill and reap ``processes`` (those still running)."""
    for p in processes:
        if p.exitcode is None:
            p.kill()
        p.join(timeout_s)


def start_ranks(model_dir: pathlib.Path, cfg: EngineConfig, gguf: pathlib.Path | None,
                timeout_s: float = 60.0) -> RankGroup:
    """Spawn this host's worker ranks of ``cfg.tensor_parallel_size`` (``1..N-1``; with ``cfg.nnodes`` H
    hosts ``1..N/H-1``, the other nodes starting theirs: :mod:`xllm.engine.nodes`) for ``model_dir`` and
    join their group as rank 0: the rendezvous (``timeout_s``: how long it waits for every rank, and each
    collective's bound), the cluster token's proof (``CollectiveError`` naming the ranks that failed it),
    the plan channel. The caller loads rank 0's shard with ``model_kwargs(0, N, group.comm)`` and builds the
    engine with the group, which stops the workers when it closes."""
    if cfg.node_rank != 0:
        raise ConfigError(f"--node-rank {cfg.node_rank} runs worker ranks only (xllm.engine.nodes), not an engine")
    size = cfg.tensor_parallel_size
    ctx = multiprocessing.get_context("spawn")
    channel: StepChannel | None = None
    comm = None
    processes: list = []
    try:
        if cfg.nnodes == 1:
            channel = PlanChannel.create(size, plan_slot_bytes(cfg), context=ctx)
            channel_spec: ChannelSpec | NetChannelSpec = channel.spec  # type: ignore[assignment]
            comm, comm_spec = _comm_spec(cfg, timeout_s)
        else:
            channel_spec = NetChannelSpec(size, plan_slot_bytes(cfg), IDLE_TIMEOUT_S)
            comm_spec = gloo_spec(cfg, timeout_s)
        processes = spawn_ranks(node_ranks(cfg)[1:], model_dir, cfg, gguf, channel_spec, comm_spec, ctx)
        with gloo_interface(comm_spec):
            if comm is None:
                comm = join_comm(comm_spec, 0, size)
            prove_group(comm, cfg.cluster_keys)
            if channel is None:
                channel = NetPlanChannel.join(channel_spec)  # type: ignore[arg-type]
        log.info("tensor parallelism: %d ranks on %d host(s) (%s collectives), this host's worker pids %s",
                 size, cfg.nnodes, comm_spec.kind, [p.pid for p in processes])
        return RankGroup(comm, channel, processes, timeout_s=timeout_s)  # type: ignore[arg-type]
    except BaseException:
        stop_processes(processes)
        if channel is not None:
            channel.close()
        if comm is not None:
            comm.close()
        raise
