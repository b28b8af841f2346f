"""The :class:`~xllm.core.parallel.comm.Communicator` of ranks on one host: collectives through a
shared-memory segment in native code (:mod:`xllm.kernels.shm_allreduce`), tens of microseconds for a
step's ``[rows, hidden]`` activations where gloo over TCP costs about a millisecond.

Rank 0 creates the group (:meth:`ShmComm.create` returns its communicator and the segment's name), the
other ranks attach by that name (:meth:`ShmComm.attach`). Every rank sums in the same (rank) order in fp32,
so all ranks hold bit-identical sums. The fused native Llama steps take :meth:`ShmComm.native_handle` and
all-reduce inside their OpenMP team. Where the native library is unavailable (``XLLM_NATIVE=0``, no
compiler) :meth:`ShmComm.available` is False and callers use :class:`~xllm.core.parallel.comm.GlooComm`.
"""

from __future__ import annotations

import os
import secrets

import torch

from xllm.core.parallel.comm import CollectiveError, PendingReduce, Reduced
from xllm.kernels import shm_allreduce

#: default per-rank buffer: a [1024, 1024] bf16 tensor in one piece (larger tensors go in pieces, one
#: synchronisation each). The segment holds two buffers per rank (2 ranks: 8 MiB of /dev/shm, whose size
#: containers often limit to 64 MiB; creating a group too large for it raises CollectiveError).
DEFAULT_MAX_BYTES = 2 << 20


class ShmComm:
    """Rank ``rank`` of ``size`` on one shared-memory segment. ``all_reduce`` sums float32 and bfloat16
    natively (other floating dtypes through a float32 copy); tensors larger than the per-rank buffer go in
    pieces. A collective that a rank does not reach within ``timeout_s`` (or whose process exited) raises
    :class:`CollectiveError` naming the rank(s); the group is unusable afterwards."""

    def __init__(self, group: shm_allreduce.ShmGroup, timeout_s: float) -> None:
        self._group = group
        self.rank, self.size = group.rank, group.size
        self.name = group.name
        self.timeout_s = timeout_s

    @staticmethod
    def available() -> bool:
        """Whether the native collectives can run here (else use GlooComm)."""
        return shm_allreduce.shm_library() is not None

    @classmethod
    def create(cls, size: int, max_bytes: int = DEFAULT_MAX_BYTES, timeout_s: float = 60.0) -> tuple[ShmComm, str]:
        """Rank 0's communicator of a new group of ``size`` ranks and the segment name the others attach by;
        ``max_bytes``: each rank's buffer (the largest piece of one collective)."""
        if size < 1 or size > 64:
            raise ValueError(f"a shared-memory group has 1 to 64 ranks, got size {size}")
        if max_bytes < 64:
            raise ValueError(f"max_bytes must be at least 64, got {max_bytes}")
        name = f"/xllm-tp-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            group = shm_allreduce.ShmGroup.create(name, size, max_bytes, timeout_s)
        except shm_allreduce.ShmError as e:
            raise CollectiveError(str(e)) from e
        return cls(group, timeout_s), name

    @classmethod
    def attach(cls, name: str, rank: int, size: int, timeout_s: float = 60.0) -> ShmComm:
        """Rank ``rank`` (>= 1) of the group rank 0 created as ``name``."""
        if not 0 < rank < size:
            raise ValueError(f"attach takes ranks 1..size-1 (rank 0 creates the group), got rank {rank} of {size}")
        try:
            return cls(shm_allreduce.ShmGroup.attach(name, rank, size, timeout_s), timeout_s)
        except shm_allreduce.ShmError as e:
            raise CollectiveError(str(e)) from e

    def native_handle(self) -> int:
        """The C context (``XllmShm *``) for kernels of the same library (the fused Llama steps)."""
        self._check()
        return self._group.handle

    def error_for(self, code: int, what: str) -> CollectiveError:
        """The error of a native kernel's failed collective over :meth:`native_handle` (``code``: the
        kernel's nonzero XSHM_* return), naming the ranks that did not arrive."""
        try:
            self._group.check(code, what)
        except shm_allreduce.ShmError as e:
            return CollectiveError(f"{e} (timeout {self.timeout_s}s)")
        raise ValueError("error_for takes a failed call's nonzero code")

    def _check(self) -> None:
        if not self._group.handle:
            raise CollectiveError(f"the shared-memory group {self.name!r} is closed")

    def _call(self, fn, *args) -> None:
        self._check()
        try:
            fn(*args)
        except shm_allreduce.ShmError as e:
            raise CollectiveError(f"{e} (timeout {self.timeout_s}s)") from e

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise TypeError(f"ShmComm reduces CPU tensors, got one on {x.device}")
        if x.dtype in shm_allreduce.DTYPES and x.is_contiguous():
            self._call(self._group.all_reduce, x)
            return x
        if not (x.dtype.is_floating_point or x.dtype in shm_allreduce.DTYPES):
            raise TypeError(f"ShmComm.all_reduce sums floating-point tensors, got {x.dtype}")
        tmp = x.contiguous() if x.dtype in shm_allreduce.DTYPES else x.to(torch.float32).contiguous()
        if tmp.data_ptr() == x.data_ptr():
            tmp = tmp.clone()
        self._call(self._group.all_reduce, tmp)
        x.copy_(tmp)
        return x

    def all_reduce_start(self, x: torch.Tensor) -> PendingReduce:
        """The sum, already done: the native all-reduce runs on this rank's own thread (nothing runs
        beside it, so an overlapped forward gains nothing here; :mod:`xllm.core.overlap` measures that)."""
        return Reduced(self.all_reduce(x))

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        if x.device.type != "cpu":
            raise TypeError(f"ShmComm gathers CPU tensors, got one on {x.device}")
        x = x.contiguous()
        out = torch.empty((self.size, *x.shape), dtype=x.dtype)
        self._call(self._group.all_gather, x, out)
        return list(out.unbind(0))

    def barrier(self) -> None:
        self._call(self._group.barrier)

    def close(self) -> None:
        self._group.close()

    def __del__(self) -> None:  # a group dropped without close(): still unmap (rank 0: unlink the name)
        group = getattr(self, "_group", None)
        if group is not None:
            group.close()
