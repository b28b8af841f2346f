"""The collectives a tensor-parallel model needs, behind one narrow contract.

A model shard holds a :class:`Communicator` and calls it where its partial results meet: after a
row-parallel projection (``all_reduce``), after a vocab-parallel embedding lookup (``all_reduce``)
and LM head (``all_gather``). One process is :class:`SingleRank` (every call a no-op, so the model
code has one path); ranks of one instance use :class:`GlooComm` (``torch.distributed`` over gloo,
any hosts) or the native shared-memory all-reduce for ranks on one host
(:mod:`xllm.core.parallel.shm`). Every rank calls the same collectives in the same order.

``all_reduce_start`` begins an all-reduce and returns a :class:`PendingReduce` to ``wait`` on: gloo's
runs in its own threads meanwhile (the overlapped forward computes one micro-batch while the other's
sum is in flight, :mod:`xllm.core.overlap`); the communicators that reduce on the caller's thread
(:class:`SingleRank`, the shared-memory one) finish it at once and return a :class:`Reduced`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class PendingReduce(Protocol):
    """An all-reduce begun by :meth:`Communicator.all_reduce_start`: ``wait()`` returns the summed tensor
    (the one passed in, summed in place) once every rank's part arrived, or raises
    :class:`CollectiveError`. Until then the caller must not read or write the tensor."""

    def wait(self) -> torch.Tensor: ...


@dataclass
class Reduced:
    """A :class:`PendingReduce` already complete (communicators that reduce on the caller's thread)."""

    tensor: torch.Tensor

    def wait(self) -> torch.Tensor:
        return self.tensor


class Communicator(Protocol):
    """Collectives over the ranks of one tensor-parallel group (``rank`` of ``size``).

    - ``all_reduce(x)``: sums ``x`` over the ranks in place and returns it (every rank gets the sum);
    - ``all_reduce_start(x)``: the same sum, begun: a :class:`PendingReduce` whose ``wait()`` returns it
      (ranks start their all-reduces in the same order; a pending one may be outstanding while the caller
      computes and starts the next);
    - ``all_gather(x)``: every rank's ``x`` (same shape and dtype on every rank), in rank order;
    - ``barrier()``: returns once every rank reached it;
    - ``close()``: leaves the group (idempotent).

    A collective that cannot complete (a rank died or hangs) raises :class:`CollectiveError` within
    the communicator's timeout instead of blocking forever.
    """

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_start(self, x: torch.Tensor) -> PendingReduce: ...

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]: ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or the group was closed."""


@dataclass
class SingleRank:
    """The group of one process: every collective is the identity."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_reduce_start(self, x: torch.Tensor) -> PendingReduce:
        return Reduced(x)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class GroupAddress:
    """Where the ranks of one group meet: rank 0's TCP store at ``host:port`` (gloo's rendezvous)."""

    host: str
    port: int
    timeout_s: float = 60.0


class GlooComm:
    """``torch.distributed`` over gloo (TCP; any hosts). One group per process (torch's default group):
    :meth:`close` destroys it."""

    def __init__(self, address: GroupAddress, rank: int, size: int) -> None:
        import torch.distributed as dist

        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"need 0 <= rank < size, got rank {rank} of {size}")
        self.rank, self.size = rank, size
        self._dist = dist
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{address.host}:{address.port}", rank=rank,
                                    world_size=size, timeout=datetime.timedelta(seconds=address.timeout_s))
        except Exception as e:  # a rendezvous that times out or is refused
            raise CollectiveError(f"rank {rank} of {size} could not join the group at "
                                  f"{address.host}:{address.port}: {e}") from e
        self._open = True

    def _check(self) -> None:
        if not self._open:
            raise CollectiveError("the group is closed")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._check()
        try:
            self._dist.all_reduce(x)
        except Exception as e:
            raise CollectiveError(f"all_reduce failed on rank {self.rank}: {e}") from e
        return x

    def all_reduce_start(self, x: torch.Tensor) -> PendingReduce:
        """``dist.all_reduce(x, async_op=True)``: gloo sums in its own threads while the caller goes on."""
        self._check()
        try:
            work = self._dist.all_reduce(x, async_op=True)
        except Exception as e:
            raise CollectiveError(f"all_reduce failed on rank {self.rank}: {e}") from e
        return _GlooPending(work, x, self.rank)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        self._check()
        out = [torch.empty_like(x) for _ in range(self.size)]
        try:
            self._dist.all_gather(out, x.contiguous())
        except Exception as e:
            raise CollectiveError(f"all_gather failed on rank {self.rank}: {e}") from e
        return out

    def barrier(self) -> None:
        self._check()
        try:
            self._dist.barrier()
        except Exception as e:
            raise CollectiveError(f"barrier failed on rank {self.rank}: {e}") from e

    def close(self) -> None:
        if self._open:
            self._open = False
            if self._dist.is_initialized():
                self._dist.destroy_process_group()


@dataclass
class _GlooPending:
    """A gloo all-reduce in flight (``work``: torch's ``Work``) summing ``tensor`` in place."""

    work: Any
    tensor: torch.Tensor
    rank: int

    def wait(self) -> torch.Tensor:
        try:
            self.work.wait()
        except Exception as e:
            raise CollectiveError(f"all_reduce failed on rank {self.rank}: {e}") from e
        return self.tensor
