"""The ranks of one tensor-parallel instance as rank 0 holds them, and what every rank agrees on at start-up.

Rank 0 (the engine process) holds a :class:`RankGroup`: the collectives' communicator, the step-plan
channel (:mod:`xllm.core.executor.channel`) and the worker processes. A worker process that exits, a
plan no worker takes, or a collective that fails is a :class:`~xllm.core.executor.channel.RankFailed`:
the instance cannot run another step.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import logging
import os
import threading
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import torch

from xllm.core.executor.channel import SHUTDOWN, RankFailed, StepChannel
from xllm.core.kv.layout import KVCacheLayout
from xllm.core.model_api import FusedForward, KVCacheSpec
from xllm.core.model_runner import ModelRunner
from xllm.core.parallel.comm import Communicator

log = logging.getLogger(__name__)


@dataclass
class RankGroup:
    """Rank 0's handle on its instance's ranks. ``processes``: this host's worker ranks, in rank order (each a
    ``multiprocessing`` process: ``sentinel``, ``exitcode``, ``pid``, ``join``, ``kill``). ``timeout_s``
    bounds a hand-off of a step plan to the workers."""

    comm: Communicator
    channel: StepChannel
    processes: list[Any]
    timeout_s: float = 30.0
    _closed: bool = False
    _watchers: list[threading.Thread] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        for rank, p in enumerate(self.processes, 1):
            t = threading.Thread(target=_reap, args=(rank, p, self), name=f"xllm-rank-{rank}-reaper", daemon=True)
            t.start()
            self._watchers.append(t)

    @property
    def size(self) -> int:
        """Every rank of the group (``processes`` are this host's workers only when ranks span hosts)."""
        return self.comm.size

    def check(self) -> None:
        """Raise :class:`RankFailed` if a worker process has exited (one ``select`` over their sentinels)."""
        if wait([p.sentinel for p in self.processes], 0):
            raise self.failure()

    def failure(self, cause: BaseException | None = None) -> RankFailed:
        """The error to stop the instance with: which ranks exited (with their exit codes), else ``cause``."""
        dead = [f"rank {i + 1} (pid {p.pid}) exited with status {p.exitcode}"
                for i, p in enumerate(self.processes) if p.exitcode is not None or wait([p.sentinel], 0)]
        if dead:
            return RankFailed("tensor-parallel instance lost a rank: " + "; ".join(dead))
        if isinstance(cause, RankFailed):
            return cause
        return RankFailed(f"tensor-parallel step failed: {cause}")

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop the workers (a shutdown message; those still running after ``timeout_s`` are killed), leave
        the group and remove the channel. Idempotent. A worker that stopped still has to leave its interpreter
        (torch's teardown): 1 s alone, more than 5 s once under a loaded CI run (it was killed after logging
        its stop), so the bound is generous; a worker that exits returns at once."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            if all(p.exitcode is None for p in self.processes):
                self.channel.publish(SHUTDOWN, b"", min(timeout_s, 1.0), self.check)
        for p, reaper in zip(self.processes, self._watchers):
            # the reaper returns once the process exited and it recorded the status (a process reaped there
            # must not be joined or killed here: its pid may already be another process's)
            reaper.join(timeout_s)
            if reaper.is_alive():  # not reaped: the pid is still this process (running, or a zombie)
                log.warning("rank process %d did not stop; killing it", p.pid)
                p.kill()
                reaper.join(timeout_s)
        with contextlib.suppress(Exception):
            self.comm.close()
        self.channel.close()


def _reap(rank: int, process: Any, group: RankGroup) -> None:
    """Wait for worker ``rank``'s process to exit and reap it at once, recording its status on the process.

    An exited child stays a zombie until its parent waits for it, and a zombie still exists to the
    collectives' liveness checks (``kill(pid, 0)``): rank 0 would wait out a collective's whole timeout
    instead of failing at once. The wait is libc's ``waitpid`` through ctypes, which releases the GIL, so
    it reaps even while the engine thread holds the GIL in a native kernel that waits for the dead rank."""
    libc = ctypes.CDLL(None, use_errno=True)
    status = ctypes.c_int(0)
    while True:
        pid = libc.waitpid(ctypes.c_int(process.pid), ctypes.byref(status), ctypes.c_int(0))
        if pid == process.pid:
            break
        if ctypes.get_errno() != errno.EINTR:
            return  # reaped elsewhere (multiprocessing's own join): it has the status
    popen = getattr(process, "_popen", None)
    if popen is not None and getattr(popen, "returncode", 0) is None:
        popen.returncode = os.waitstatus_to_exitcode(status.value)  # what multiprocessing would have recorded
    if not group._closed:
        log.error("tensor-parallel rank %d (pid %d) exited with status %s", rank, process.pid, process.exitcode)


@dataclass(frozen=True)
class RankSetup:
    """What rank 0 tells each worker before the first step (the ``SETUP`` message): the KV backend class
    and layout to build (the worker's own KV heads replace ``layout.spec``'s) and the runner settings. A
    ``DRAFT_SETUP`` message's (``--speculative self``) also names the draft's layers: the model's first
    ``draft_layers`` (:mod:`xllm.core.executor.draft_rank`)."""

    backend: type
    layout: KVCacheLayout
    native_decode: bool
    draft_layers: int = 0


def mirror_kv(setup: RankSetup, local: KVCacheSpec):
    """A worker's KV backend: rank 0's class and layout over the worker's own KV heads (``local``). An
    xTensor mirror takes rank 0's mappings (it places nothing itself: its map budget is every block)."""
    layout = dataclasses.replace(setup.layout, spec=local)
    if hasattr(setup.backend, "apply_mappings"):
        return setup.backend(layout, map_budget=layout.num_blocks)
    return setup.backend(layout)


class _CappedFused:
    """A fused forward whose row limits are every rank's least (the ranks must take the same paths)."""

    serves_lora = False  # LoRA adapters are not served with tensor parallelism

    def __init__(self, inner: FusedForward, max_batch: int, max_step_tokens: int) -> None:
        self.inner = inner
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens

    def supports(self, kv) -> bool:
        return self.inner.supports(kv)

    def __call__(self, input_ids, positions, slots, kv):
        return self.inner(input_ids, positions, slots, kv)

    def step(self, tokens, kv):
        return self.inner.step(tokens, kv)


def agree_capabilities(runner: ModelRunner, comm: Communicator) -> None:
    """Every rank calls this once, before any step: the ranks' runners take the fused paths only if every
    rank has one, within every rank's row limits, so that every rank chooses the same path for a step
    (:meth:`~xllm.core.model_runner.ModelRunner.path`). ``ValueError`` (on every rank alike) when the ranks' KV
    layouts differ in blocks or block size."""
    fused, layout = runner.fused, runner.kv.layout
    mine = torch.tensor([fused is not None, fused.max_batch if fused else 0, fused.max_step_tokens if fused else 0,
                         layout.num_blocks, layout.block_size], dtype=torch.float32)
    rows = torch.stack(comm.all_gather(mine)).to(torch.int64)
    if bool((rows[:, 3:] != rows[0, 3:]).any()):
        raise ValueError("the tensor-parallel ranks' KV layouts differ (blocks, block size per rank: "
                         f"{rows[:, 3:].tolist()}); --tensor-parallel-size needs one KV layout on every rank")
    if not bool(rows[:, 0].all()):
        runner.fused = None
        return
    max_batch, max_step = int(rows[:, 1].min()), int(rows[:, 2].min())
    if fused is not None and (fused.max_batch != max_batch or fused.max_step_tokens != max_step):
        runner.fused = _CappedFused(fused, max_batch, max_step)
