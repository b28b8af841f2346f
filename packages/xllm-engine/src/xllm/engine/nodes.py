"""A node R > 0 of a tensor-parallel instance over several hosts: ``xllm engine --nnodes H --node-rank R``.

Every node runs the same command line (model, engine flags, ``--tensor-parallel-size N``, ``--master-addr``,
``--master-port``, the cluster token) but ``--node-rank``. Node 0 is the engine (rank 0: scheduler, sampling,
the gRPC service; :func:`xllm.engine.loader.load_engine`) with ranks ``1..N/H-1``; node R runs ranks
``R*N/H..(R+1)*N/H-1`` only (:func:`run_node`): it starts them (:func:`xllm.engine.ranks.rank_main`: they
meet rank 0 at ``--master-addr:--master-port``, prove the cluster token, load their shards and take rank
0's step plans over the network), waits on them and exits with status 0 once all stopped cleanly (rank 0
shut the instance down), 1 when one failed (a wrong token, rank 0 gone, a failed step). It serves nothing
and registers nothing; SIGTERM/SIGINT stop its ranks.

Start the nodes within the rendezvous timeout of each other (a minute: rank 0 waits that long for every
rank, a rank that long for rank 0's store). All ranks use gloo over TCP, the ranks of one host too (not
shared memory yet); the traffic is authenticated at the rendezvous (the cluster token), not encrypted: keep
the hosts on a private network. An instance idle longer than
:data:`~xllm.engine.ranks.IDLE_TIMEOUT_S` loses its remote ranks (the plan channel's group timeout).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
from multiprocessing.connection import wait

from xllm.core.config import EngineConfig
from xllm.core.executor.net_channel import NetChannelSpec
from xllm.engine.loader import stored_gguf
from xllm.engine.ranks import IDLE_TIMEOUT_S, gloo_spec, node_ranks, plan_slot_bytes, spawn_ranks, stop_processes
from xllm.engine_api.errors import ConfigError
from xllm.models import resolve_model

log = logging.getLogger(__name__)

FAILED_GRACE_S = 10.0  # once one rank failed, how long the others may take to fail too before they are killed


def run_node(model: str | None, cfg: EngineConfig, progress: bool = True, timeout_s: float = 60.0) -> int:
    """Run node ``cfg.node_rank`` (> 0)'s ranks until they stop; the exit status (0: all stopped cleanly).
    ``timeout_s``: the rendezvous' and each collective's bound, as rank 0's (:func:`~xllm.engine.ranks.start_ranks`).
    ``ConfigError`` for node 0 (it runs the engine); ``SecurityConfigError`` for a ``--master-addr`` beyond
    loopback without the cluster token."""
    if cfg.node_rank == 0:
        raise ConfigError("--node-rank 0 runs the engine (xllm.engine.loader.load_engine), not run_node")
    comm = gloo_spec(cfg, timeout_s)  # refuses a reachable rendezvous without the token before anything starts
    stored = stored_gguf(model, cfg)
    model_dir = resolve_model(model, progress=progress, weights=stored is None)
    channel = NetChannelSpec(cfg.tensor_parallel_size, plan_slot_bytes(cfg), IDLE_TIMEOUT_S)
    ranks = node_ranks(cfg)
    processes = spawn_ranks(ranks, model_dir, cfg, stored, channel, comm, multiprocessing.get_context("spawn"))
    log.info("node %d of %d: ranks %d..%d of %d (pids %s) join rank 0 at %s:%d", cfg.node_rank, cfg.nnodes,
             ranks[0], ranks[-1], cfg.tensor_parallel_size, [p.pid for p in processes], comm.address.host,
             comm.address.port)
    return wait_ranks(processes)


def wait_ranks(processes: list) -> int:
    """Wait for ``processes`` to exit; 0 if every one exited with status 0, else 1 (once one failed, the
    others get :data:`FAILED_GRACE_S` to fail too, then are killed). SIGTERM/SIGINT kill them and give 1."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    main = threading.current_thread() is threading.main_thread()  # (signal handlers: the main thread's only)
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        deadline = None
        while True:
            running = [p for p in processes if p.exitcode is None]
            failed = [p for p in processes if p.exitcode not in (None, 0)]
            if not running:
                break
            if failed and deadline is None:
                log.error("rank process(es) %s failed (status %s)", [p.pid for p in failed],
                          [p.exitcode for p in failed])
                deadline = time.monotonic() + FAILED_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                break
            wait([p.sentinel for p in running], 0.5)
            for p in running:
                p.join(0)
    except SystemExit as exc:
        log.warning("node stopping (%s): killing its ranks", exc.code)
        stop_processes(processes)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    stop_processes(processes)
    codes = [p.exitcode for p in processes]
    log.info("node's ranks exited with status %s", codes)
    return 0 if all(c == 0 for c in codes) else 1
