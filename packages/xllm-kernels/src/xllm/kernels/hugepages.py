"""Memory on transparent huge pages for the tensors the kernels stream every step (a model's weights).

A decode step reads every weight once, and on 4 KiB pages that is one TLB miss per 4 KiB and a page
walk the hardware prefetchers stop at: SmolLM2's Q8_0 layer set plus its LM head (143 MB) streamed at
14.6-16.9 GB/s from ordinary memory against 21.0-22.3 GB/s from 2 MiB pages on this session's AMX Xeon
(GEMVs at one row, 2 threads, interleaved runs; Q4_1 +20 %, int8 +39 %, the bf16 packed GEMM +30 % at
one row and +15 % at 64; the decode attention over the KV cache +3-7 %: docs/performance.md).

:class:`HugePageArena` maps one anonymous region advised ``MADV_HUGEPAGE`` (Linux's transparent huge
pages in their ``madvise`` mode, the common default; ``always`` gives them anyway) and hands out
64-byte-aligned tensors from it one after another: a model's weights placed in the order its layers
stream them (:func:`xllm.models.placement.place_weights`). The region is unmapped when the last tensor
taken from it is freed. Where the kernel refuses the advice (no THP, ``never``), or with
``XLLM_HUGEPAGES=0``, the arena is ordinary memory: the same tensors, 4 KiB pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import os

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64
_MADV_HUGEPAGE = 14


def enabled() -> bool:
    """Whether arenas ask for huge pages (Linux, and ``XLLM_HUGEPAGES`` is not ``0``)."""
    return os.environ.get("XLLM_HUGEPAGES", "1") != "0" and hasattr(mmap, "MAP_ANONYMOUS") and os.name == "posix"


def _madvise_huge(addr: int, length: int) -> bool:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(addr, length, _MADV_HUGEPAGE) == 0


class HugePageArena:
    """``nbytes`` of memory handed out as tensors (:meth:`take`, :meth:`copy`) in order, 64-byte aligned,
    on 2 MiB pages where the OS gives them (:attr:`huge`). Never reused: a tensor's bytes stay its own
    until the whole region goes (when the arena and every tensor from it are gone)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(int(nbytes), 0)
        self.used = 0
        self.huge = False
        if not enabled() or self.nbytes == 0:
            self._base = torch.empty(self.nbytes + _ALIGN, dtype=torch.uint8)
        else:
            size = math.ceil(self.nbytes / HUGE_PAGE) * HUGE_PAGE
            region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            raw = torch.frombuffer(region, dtype=torch.uint8)  # (keeps the mapping alive)
            start = (-raw.data_ptr()) % HUGE_PAGE
            self.huge = _madvise_huge(raw.data_ptr() + start, size)
            if not self.huge:
                log.info("transparent huge pages unavailable (madvise failed): weights on 4 KiB pages")
            self._base = raw[start:start + size]
        self._offset = (-self._base.data_ptr()) % _ALIGN

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A new uninitialized contiguous tensor of the arena (ValueError when it is full)."""
        numel = math.prod(shape)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        start = self._offset + self.used
        if start + nbytes > self._base.numel():
            raise ValueError(f"arena of {self.nbytes} bytes full: {nbytes} more asked, {self.used} used")
        self.used = (start + nbytes + _ALIGN - 1) // _ALIGN * _ALIGN - self._offset
        return self._base[start:start + nbytes].view(dtype).view(tuple(shape))

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s values in a tensor of the arena (contiguous, same shape and dtype)."""
        out = self.take(t.shape, t.dtype)
        out.copy_(t)
        return out

    @staticmethod
    def bytes_for(tensors: list[torch.Tensor]) -> int:
        """Bytes an arena needs to :meth:`copy` every one of ``tensors``."""
        return sum((t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN for t in tensors)
