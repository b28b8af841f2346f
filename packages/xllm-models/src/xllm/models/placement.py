"""Where a loaded model's weights live: one huge-page arena for the tensors the kernels stream.

:func:`place_weights` copies every tensor of :class:`StreamsWeights.streamed_tensors` (in that order:
the order the layers read them) into one :class:`xllm.kernels.hugepages.HugePageArena` and repoints each
tensor object at its copy in place (``Tensor.set_``), so every holder of it (a tied LM head, a fused
forward's packed list, a parameter) reads the copy and the old storage (a GGUF file's memory map, the
quantizer's buffers) is released. Done once at the end of loading, before any forward binds pointers.
Measured gains of the huge pages: :mod:`xllm.kernels.hugepages`.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

import torch

from xllm.kernels.hugepages import HugePageArena

log = logging.getLogger(__name__)


@runtime_checkable
class StreamsWeights(Protocol):
    """A model that names the tensors its kernels stream every step (weights and packed copies, in the
    order a step reads them); :func:`place_weights` places them. Naming them makes its packed copies at
    load, so whoever writes its weights in place afterwards calls :meth:`drop_packed`."""

    def streamed_tensors(self) -> list[torch.Tensor]: ...

    def drop_packed(self) -> None:
        """Forget the packed copies (and whatever was bound over them) after an in-place weight write."""
        ...


@torch.no_grad()
def place_weights(model: StreamsWeights) -> HugePageArena | None:
    """Move ``model.streamed_tensors()`` (CPU ones, each tensor object once) into one arena; returns it
    (None when there is nothing to place). Values, shapes and dtypes are unchanged."""
    seen: set[int] = set()
    tensors = []
    for t in model.streamed_tensors():
        if t.device.type == "cpu" and id(t) not in seen and t.numel():
            seen.add(id(t))
            tensors.append(t)
    if not tensors:
        return None
    arena = HugePageArena(HugePageArena.bytes_for(tensors))
    for t in tensors:
        t.set_(arena.copy(t.contiguous()))
    log.info("placed %d weight tensors (%.1f MB) on %s", len(tensors), arena.used / 1e6,
             "2 MiB huge pages" if arena.huge else "4 KiB pages")
    return arena
