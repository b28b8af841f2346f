"""The step-plan channel: one writer (rank 0), ``size - 1`` readers (the worker ranks), over shared memory.

A :class:`PlanChannel` is a ring of ``slots`` fixed-size message slots in one
``multiprocessing.shared_memory`` segment, plus a control block: the sequence number each reader has
acknowledged. A message is ``(kind, payload bytes)``; the writer fills slot ``seq % slots``, stamps
its sequence number last (x86 keeps stores in order), then posts every reader's semaphore once. A
reader spins briefly on its semaphore, then blocks on it in short waits, checking between them that
its parent (rank 0) is alive; once it has copied a message out it acknowledges it. The writer
reuses a slot only once every reader acknowledged the message it held, so a reader never sees a
message overwritten while it reads it.

Every wait is bounded: a writer whose readers stop acknowledging, or a reader whose parent died,
raises :class:`RankFailed` instead of blocking forever.

:class:`StepChannel` is the contract rank 0's runner and a worker's loop use; :class:`PlanChannel` is its
one-host implementation, :class:`~xllm.core.executor.net_channel.NetPlanChannel` the one for ranks on
several hosts (``torch.distributed`` broadcasts).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Protocol

import numpy as np

from xllm.core.parallel.comm import CollectiveError

# message kinds
SETUP = 1     # rank 0's KV layout and runner settings (once, a pickle)
STEP = 2      # one forward: a packed step plan (xllm.core.executor.plan)
OPS = 3       # KV mapping operations to apply now (a step's that did not fit its message)
SHUTDOWN = 4  # leave the loop
# the same three for the draft model of ``--speculative self`` (the target's first layers, its own KV memory:
# xllm.core.executor.draft_rank)
DRAFT_SETUP = 5
DRAFT_STEP = 6
DRAFT_OPS = 7

_CONTROL = 64  # int64 words before the slots: [0] the writer's last sequence, [1 + r] reader r's acknowledgement
_SLOT_HEADER = 4  # int64 words per slot: sequence, kind, payload bytes, spare


class RankFailed(CollectiveError):
    """A rank of a tensor-parallel instance died or stopped answering: the instance cannot run another
    step (every rank takes part in every forward). Fatal: the engine stops serving."""


class ChannelLimits(Protocol):
    """What a channel's writer must know of it: ``size`` ranks, messages of at most ``slot_bytes``."""

    @property
    def size(self) -> int: ...

    @property
    def slot_bytes(self) -> int: ...


class StepChannel(Protocol):
    """The step-plan channel of one tensor-parallel instance: rank 0 writes, ranks ``1..size-1`` read, every
    reader every message, in order.

    - ``publish(kind, payload, timeout_s, check)`` (rank 0): send one message (at most ``spec.slot_bytes``,
      else ``ValueError``); its sequence number (1, 2, ...). It may return before the readers took it, but
      waits (at most ``timeout_s``, calling ``check`` between waits: it raises for a dead rank) for earlier
      messages to be taken as far as it needs, else :class:`RankFailed`;
    - ``wait_acked(seq, timeout_s, check)`` (rank 0): return once every reader took message ``seq``, else
      :class:`RankFailed` after ``timeout_s``;
    - ``receive(alive)`` (a reader): the next message ``(kind, payload)``; blocks until there is one, for as
      long as rank 0 lives: :class:`RankFailed` once ``alive()`` is False or rank 0's side is gone;
    - ``close()``: leave the channel (idempotent).
    """

    rank: int
    seq: int

    @property
    def spec(self) -> ChannelLimits: ...

    def publish(self, kind: int, payload: bytes | np.ndarray, timeout_s: float,
                check: Callable[[], None] | None = None) -> int: ...

    def wait_acked(self, seq: int, timeout_s: float, check: Callable[[], None] | None = None) -> None: ...

    def receive(self, alive: Callable[[], bool]) -> tuple[int, bytes]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ChannelSpec:
    """What a reader needs to attach (picklable at process start: the semaphores travel with the spawn)."""

    name: str
    size: int
    slots: int
    slot_bytes: int
    wakeups: tuple[Any, ...]  # one multiprocessing semaphore per reader (index rank - 1)


class PlanChannel:
    """One side of the ring (see the module docstring): :meth:`create` on rank 0 (the writer),
    :meth:`attach` on a worker rank (a reader)."""

    def __init__(self, spec: ChannelSpec, shm: shared_memory.SharedMemory, rank: int, owner: bool) -> None:
        self.spec = spec
        self.rank = rank
        self._shm = shm
        self._owner = owner
        buf = shm.buf
        self._control = np.ndarray((_CONTROL,), dtype=np.int64, buffer=buf)
        stride = _SLOT_HEADER * 8 + spec.slot_bytes
        self._stride = stride
        self._headers = [np.ndarray((_SLOT_HEADER,), dtype=np.int64, buffer=buf, offset=_CONTROL * 8 + i * stride)
                         for i in range(spec.slots)]
        self._payloads = [np.ndarray((spec.slot_bytes,), dtype=np.uint8, buffer=buf,
                                     offset=_CONTROL * 8 + i * stride + _SLOT_HEADER * 8) for i in range(spec.slots)]
        self.seq = 0  # the last sequence written (writer) or read (reader)

    @classmethod
    def create(cls, size: int, slot_bytes: int, slots: int = 4, context=None) -> PlanChannel:
        """The writer's side for ``size`` ranks (``size - 1`` readers), ``slots`` messages of up to
        ``slot_bytes`` each; ``context``: the multiprocessing context the readers are started with."""
        if size < 2 or size > _CONTROL - 1:
            raise ValueError(f"a plan channel serves 2..{_CONTROL - 1} ranks, not {size}")
        ctx = context or multiprocessing.get_context("spawn")
        slot_bytes = -(-slot_bytes // 8) * 8
        total = _CONTROL * 8 + slots * (_SLOT_HEADER * 8 + slot_bytes)
        shm = shared_memory.SharedMemory(create=True, size=total)
        np.ndarray((total,), dtype=np.uint8, buffer=shm.buf)[:_CONTROL * 8 + _SLOT_HEADER * 8] = 0
        for i in range(slots):
            np.ndarray((_SLOT_HEADER,), dtype=np.int64, buffer=shm.buf,
                       offset=_CONTROL * 8 + i * (_SLOT_HEADER * 8 + slot_bytes))[:] = -1
        spec = ChannelSpec(shm.name, size, slots, slot_bytes, tuple(ctx.Semaphore(0) for _ in range(size - 1)))
        return cls(spec, shm, 0, owner=True)

    @classmethod
    def attach(cls, spec: ChannelSpec, rank: int) -> PlanChannel:
        """Reader ``rank`` (1..size-1) of the channel ``spec`` describes."""
        if not 1 <= rank < spec.size:
            raise ValueError(f"a reader's rank is 1..{spec.size - 1}, not {rank}")
        # (a spawned reader shares rank 0's resource tracker, which already tracks the segment: it is removed
        # when rank 0 closes the channel, or by the tracker if rank 0 dies)
        shm = shared_memory.SharedMemory(name=spec.name, create=False)
        return cls(spec, shm, rank, owner=False)

    # ---- the writer --------------------------------------------------------------
    def publish(self, kind: int, payload: bytes | np.ndarray, timeout_s: float,
                check: Callable[[], None] | None = None) -> int:
        """Write one message and wake the readers; its sequence number. Waits (at most ``timeout_s``,
        calling ``check`` between waits: it raises for a dead reader) for the slot's previous message to
        be acknowledged by every reader, else :class:`RankFailed`. ``ValueError`` if it does not fit."""
        data = np.frombuffer(payload, dtype=np.uint8) if isinstance(payload, bytes | bytearray) else \
            payload.reshape(-1).view(np.uint8)
        if len(data) > self.spec.slot_bytes:
            raise ValueError(f"a {len(data)}-byte step plan exceeds the plan channel's {self.spec.slot_bytes}-byte "
                             "messages")
        seq = self.seq + 1
        self.wait_acked(seq - self.spec.slots, timeout_s, check)
        i = seq % self.spec.slots
        header = self._headers[i]
        header[0] = -1
        self._payloads[i][:len(data)] = data
        header[1] = kind
        header[2] = len(data)
        header[0] = seq  # last: a reader that sees it sees the payload
        self._control[0] = seq
        self.seq = seq
        for sem in self.spec.wakeups:
            sem.release()
        return seq

    def wait_acked(self, seq: int, timeout_s: float, check: Callable[[], None] | None = None) -> None:
        """Return once every reader acknowledged message ``seq`` (spinning briefly, then in 0.2 ms naps,
        calling ``check`` between them: it raises for a dead reader); :class:`RankFailed` after ``timeout_s``."""
        acks = self._control[1:self.spec.size]
        if seq <= 0 or int(acks.min()) >= seq:
            return
        deadline = time.monotonic() + timeout_s
        spins = 0
        while int(acks.min()) < seq:
            spins += 1
            if spins > 200:
                if check is not None:
                    check()
                if time.monotonic() > deadline:
                    late = [r + 1 for r, a in enumerate(acks.tolist()) if a < seq]
                    raise RankFailed(f"rank(s) {late} took no step plan for {timeout_s:.0f} s")
                time.sleep(0.0002)

    # ---- a reader ----------------------------------------------------------------
    def receive(self, alive: Callable[[], bool], poll_s: float = 0.2, spin: int = 2000) -> tuple[int, bytes]:
        """The next message ``(kind, payload)``, acknowledged. Spins ``spin`` times, then waits on the
        semaphore ``poll_s`` at a time; between waits ``alive()`` False (the writer's process is gone)
        raises :class:`RankFailed`."""
        sem = self.spec.wakeups[self.rank - 1]
        got = False
        for _ in range(spin):
            if sem.acquire(False):
                got = True
                break
        while not got:
            got = sem.acquire(True, poll_s)
            if not got and not alive():
                raise RankFailed(f"rank {self.rank}: rank 0 (pid {os.getppid()}) is gone")
        seq = self.seq + 1
        header = self._headers[seq % self.spec.slots]
        if int(header[0]) != seq:
            raise RankFailed(f"rank {self.rank}: expected step plan {seq}, the channel holds {int(header[0])}")
        kind, n = int(header[1]), int(header[2])
        payload = self._payloads[seq % self.spec.slots][:n].tobytes()
        self.seq = seq
        self._control[self.rank] = seq
        return kind, payload

    def close(self) -> None:
        """Detach (the writer also removes the segment). Idempotent."""
        if self._shm is None:
            return
        self._control = None  # type: ignore[assignment]
        self._headers = []
        self._payloads = []
        shm, self._shm = self._shm, None
        shm.close()
        if self._owner:
            shm.unlink()
