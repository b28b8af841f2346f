"""The KV cache backend interface and the backend registry."""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from xllm.core.model_api import KVCacheSpec

_BACKENDS = {
    "contiguous": "xllm.core.kv.contiguous:ContiguousKVCache",
}


@dataclass(frozen=True)
class KVCacheLayout:
    """Sizes every backend agrees on."""

    spec: KVCacheSpec
    dtype: torch.dtype
    device: torch.device
    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_blocks: int  # physical capacity in blocks of block_size tokens

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)


class KVCacheBackend(ABC):
    """KV memory for up to ``max_num_seqs`` sequences.

    Contract: ``allocate(seq, n)`` reserves room for ``seq``'s next ``n`` tokens
    (``seq.num_computed_tokens .. + n``), assigning ``seq.slot`` on first use;
    it returns False, changing nothing, when memory or slots are exhausted.
    ``free(seq)`` releases everything and clears ``seq.slot``.
    ``layer_kv(layer)`` returns the K and V tensors attention reads.
    """

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout

    @abstractmethod
    def allocate(self, seq, num_new_tokens: int) -> bool: ...

    @abstractmethod
    def free(self, seq) -> None: ...

    @abstractmethod
    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    @property
    @abstractmethod
    def num_free_blocks(self) -> int: ...

    @property
    def usage(self) -> float:
        """Fraction of physical KV blocks in use."""
        return 1.0 - self.num_free_blocks / self.layout.num_blocks

    @property
    def free_tokens(self) -> int:
        return self.num_free_blocks * self.layout.block_size


def create_kv_cache(name: str, layout: KVCacheLayout) -> KVCacheBackend:
    """Instantiate the backend registered as ``name``."""
    target = _BACKENDS.get(name)
    if target is None:
        raise ValueError(f"unknown KV cache backend {name!r}; known: {sorted(_BACKENDS)}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(layout)
