"""Process memory housekeeping shared by the processes that free large tensors (no torch)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere). Without it a process
    that dropped large tensors keeps their resident size: glibc keeps the freed arenas (measured on SmolLM2
    int8 quantized at load: 665 MB resident before, 367 MB after). Used after quantizing at load and when an
    engine sleeps."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(name).malloc_trim(0)
