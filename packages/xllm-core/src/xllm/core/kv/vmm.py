"""Virtual memory control on Linux through libc (ctypes): reserve address ranges
and map pages of a memfd into them at fixed addresses.

A reserved range is an anonymous, private, *read-only* mapping with
``MAP_NORESERVE``: it costs no RAM and no commit charge, and reading an
untouched page returns zeros from the kernel's shared zero page, so a kernel
that reads past a sequence's length never faults. Mapping a physical page
replaces part of the range with a ``MAP_SHARED`` read-write view of the memfd;
unmapping puts the read-only reservation back. ctypes releases the GIL during
these calls, so a helper thread can map pages while the model runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import time
from dataclasses import dataclass

PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
OS_PAGE = mmap.PAGESIZE


def _libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.munmap.restype = ctypes.c_int
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


class VMMError(OSError):
    """A virtual-memory call failed."""


def supported() -> bool:
    """True where memfd + fixed mappings work (Linux with os.memfd_create)."""
    return hasattr(os, "memfd_create") and os.uname().sysname == "Linux"


@dataclass
class MapStats:
    """Counts and seconds spent in map/unmap calls (for the mapping-cost report)."""

    maps: int = 0
    unmaps: int = 0
    map_seconds: float = 0.0
    unmap_seconds: float = 0.0


class VirtualMemory:
    """libc mmap wrappers with accounting; thread-safe."""

    def __init__(self) -> None:
        if not supported():
            raise VMMError("virtual memory control needs Linux with memfd_create")
        self._libc = _libc()
        self.stats = MapStats()
        self._lock = threading.Lock()

    def _mmap(self, addr: int | None, size: int, prot: int, flags: int, fd: int, offset: int) -> int:
        out = self._libc.mmap(addr, size, prot, flags, fd, offset)
        if out is None or out == _MAP_FAILED:
            err = ctypes.get_errno()
            raise VMMError(err, f"mmap(size={size}, offset={offset}) failed: {os.strerror(err)}")
        return out

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of address space (read-only zeros); returns the address."""
        _check_aligned(size)
        return self._mmap(None, size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)

    def map_fixed(self, addr: int, size: int, fd: int, offset: int) -> None:
        """Map ``[offset, offset + size)`` of ``fd`` read-write at ``addr`` (replacing what was there)."""
        _check_aligned(addr, size, offset)
        t0 = time.perf_counter()
        self._mmap(addr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, offset)
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.maps += 1
            self.stats.map_seconds += dt

    def unmap_to_reserve(self, addr: int, size: int) -> None:
        """Put the read-only zero reservation back over ``[addr, addr + size)``."""
        _check_aligned(addr, size)
        t0 = time.perf_counter()
        self._mmap(addr, size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0)
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.unmaps += 1
            self.stats.unmap_seconds += dt

    def release(self, addr: int, size: int) -> None:
        """Give a whole reserved range back to the OS."""
        if self._libc.munmap(addr, size) != 0:
            err = ctypes.get_errno()
            raise VMMError(err, f"munmap failed: {os.strerror(err)}")


def free_map_slots(margin_fraction: float = 0.1, min_margin: int = 4096) -> int | None:
    """How many more memory mappings (VMAs) this process may create, keeping a margin for everything
    else it maps: ``vm.max_map_count`` less the mappings it has now less the margin (a tenth of the
    limit, at least ``min_margin``); None where the limit cannot be read. Past the limit, ``mmap``
    fails with ENOMEM however much memory is free."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read().strip())
        with open("/proc/self/maps") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    return max(0, limit - used - max(min_margin, int(limit * margin_fraction)))


def _check_aligned(*values: int) -> None:
    for v in values:
        if v % OS_PAGE:
            raise VMMError(f"{v} is not a multiple of the OS page size {OS_PAGE}")
