"""ctypes binding of the shared-memory collectives (``kernels/cpu/shm_allreduce.c``; protocol and contract in
``shm_allreduce.h``): all-reduce (sum) of float32 / bfloat16 tensors, all-gather of equal-size byte buffers and
barrier among the ranks of one host, through one segment in ``/dev/shm``.

Both native libraries carry them (the AVX-512 one, whose fused Llama steps call them inside their OpenMP
team, and the AVX2 one): :func:`shm_library` takes the first available. The calls go through a
:class:`ctypes.CDLL` of the same library (one dlopen handle, so a context is valid for the fused kernels
too) and release the GIL while they wait for the other ranks.

Return codes (``XSHM_*``): 0 ok; :data:`TIMEOUT` (a rank did not arrive in time: :meth:`ShmGroup.missing`
names it), :data:`PEER_DEAD` (a rank's process exited), :data:`BROKEN` (an earlier collective failed: the
group is unusable); :class:`ShmError` carries the code.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from dataclasses import dataclass

import torch

from xllm.kernels import native

OK, TIMEOUT, PEER_DEAD, BROKEN, BAD_ARG = 0, -1, -2, -3, -4
_MESSAGES = {TIMEOUT: "timed out waiting for rank(s)", PEER_DEAD: "the process of a rank exited",
             BROKEN: "an earlier collective of the group failed", BAD_ARG: "bad argument"}
#: the C dtype tag of each tensor dtype the all-reduce sums natively
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class ShmError(RuntimeError):
    """A shared-memory collective failed; ``code`` is the XSHM_* code, ``missing`` the ranks that did not arrive."""

    def __init__(self, message: str, code: int = BROKEN, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.missing = missing


@functools.cache
def _bind(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path, use_errno=True)
    vp, i64, i32, dbl = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    for name, args, res in (
        ("xllm_shm_create", [ctypes.c_char_p, i64, i64, dbl], vp),
        ("xllm_shm_attach", [ctypes.c_char_p, i64, i64, dbl], vp),
        ("xllm_shm_close", [vp], None),
        ("xllm_shm_capacity", [vp], i64),
        ("xllm_shm_missing", [vp], ctypes.c_uint64),
        ("xllm_shm_all_reduce", [vp, vp, i64, i32], i32),
        ("xllm_shm_all_gather", [vp, vp, i64, vp], i32),
        ("xllm_shm_barrier", [vp], i32),
    ):
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
    return lib


def shm_library() -> ctypes.CDLL | None:
    """The collectives' library (the AVX-512 native library, else the AVX2 one); None where neither is
    available (``XLLM_NATIVE=0``, no compiler): callers then use gloo."""
    lib = native.library() or native.avx2_library()
    return None if lib is None else _bind(str(lib.path))


@dataclass
class ShmGroup:
    """One rank's handle on a segment: the C context (``handle``) and the library that made it."""

    lib: ctypes.CDLL
    handle: int
    rank: int
    size: int
    name: str

    @classmethod
    def create(cls, name: str, size: int, buf_bytes: int, timeout_s: float) -> ShmGroup:
        """Rank 0: create segment ``name`` (``/xllm-...``) for ``size`` ranks, ``buf_bytes`` per rank buffer."""
        lib = _require()
        h = lib.xllm_shm_create(name.encode(), size, buf_bytes, timeout_s)
        if not h:
            err = ctypes.get_errno() or 0
            raise ShmError(f"cannot create shared-memory segment {name!r} for {size} ranks "
                           f"({buf_bytes} bytes per buffer): {os.strerror(err) if err else 'failed'}")
        return cls(lib, h, 0, size, name)

    @classmethod
    def attach(cls, name: str, rank: int, size: int, timeout_s: float) -> ShmGroup:
        """Rank ``rank`` > 0: open segment ``name`` (waits up to ``timeout_s`` for rank 0 to create it)."""
        lib = _require()
        h = lib.xllm_shm_attach(name.encode(), rank, size, timeout_s)
        if not h:
            err = ctypes.get_errno()
            why = {errno.ETIMEDOUT: f"absent after {timeout_s}s", errno.EINVAL: "made for another group size"}.get(
                err, os.strerror(err) if err else "failed")
            raise ShmError(f"rank {rank} of {size} cannot attach shared-memory segment {name!r} ({why})", TIMEOUT)
        return cls(lib, h, rank, size, name)

    @property
    def capacity(self) -> int:
        return int(self.lib.xllm_shm_capacity(self.handle))

    def missing(self) -> tuple[int, ...]:
        bits = int(self.lib.xllm_shm_missing(self.handle))
        return tuple(r for r in range(self.size) if bits >> r & 1)

    def check(self, rc: int, what: str) -> None:
        """Raise :class:`ShmError` for a failed call's code ``rc``."""
        if rc == OK:
            return
        missing = self.missing() if rc in (TIMEOUT, PEER_DEAD) else ()
        who = f" {list(missing)}" if missing else ""
        raise ShmError(f"{what} on rank {self.rank} of {self.size}: {_MESSAGES.get(rc, f'error {rc}')}{who}",
                       rc, missing)

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum contiguous float32 / bfloat16 CPU ``x`` over the ranks in place."""
        self.check(self.lib.xllm_shm_all_reduce(self.handle, x.data_ptr(), x.numel(), DTYPES[x.dtype]), "all_reduce")

    def all_gather(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (``size`` times ``x``'s bytes, contiguous) = every rank's contiguous ``x``, in rank order."""
        nbytes = x.numel() * x.element_size()
        self.check(self.lib.xllm_shm_all_gather(self.handle, x.data_ptr(), nbytes, out.data_ptr()), "all_gather")

    def barrier(self) -> None:
        self.check(self.lib.xllm_shm_barrier(self.handle), "barrier")

    def close(self) -> None:
        """Unmap (rank 0 also unlinks the segment); idempotent."""
        if self.handle:
            self.lib.xllm_shm_close(self.handle)
            self.handle = 0


def _require() -> ctypes.CDLL:
    lib = shm_library()
    if lib is None:
        raise ShmError(f"the native library is unavailable ({native.unavailable_reason()}): use GlooComm")
    return lib
