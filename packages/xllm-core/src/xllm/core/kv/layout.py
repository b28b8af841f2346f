"""The sizes every KV backend agrees on (:class:`KVCacheLayout`) and a backend's prefix-cache counts."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from xllm.core.model_api import KVCacheSpec
from xllm.kernels import kv_quant


@dataclass(frozen=True)
class KVCacheLayout:
    """Sizes every backend agrees on.

    ``kv_dtype`` is ``"auto"`` (K/V stored in ``dtype``, ``[..., kv_heads, head_dim]`` tensors) or a
    quantized kind of :data:`~xllm.engine_api.names.KV_CACHE_DTYPES` (``int8``, ``fp8_e4m3``): then
    every layer's K and V are ``uint8`` tensors of token rows (:mod:`xllm.kernels.kv_quant`: per
    head ``head_dim`` codes + an fp32 scale), each row padded to a multiple of ``row_align`` bytes
    (xTensor: so a block is whole OS pages).
    """

    spec: KVCacheSpec
    dtype: torch.dtype
    device: torch.device
    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_blocks: int  # physical capacity in blocks (pages) of block_size tokens
    enable_prefix_cache: bool = True
    kv_dtype: str = "auto"
    row_align: int = 1

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != "auto"

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one token's row of one layer's K (``head_dim``) or V (``v_head_dim``)."""
        if self.quantized:
            return kv_quant.row_bytes(self.spec.num_kv_heads, head_dim, self.row_align)
        return self.spec.num_kv_heads * head_dim * torch.empty((), dtype=self.dtype).element_size()

    def row_shape(self, head_dim: int) -> tuple[int, ...]:
        """The trailing shape of a K/V cache tensor for one token (after slot/page and position)."""
        return (self.row_bytes(head_dim),) if self.quantized else (self.spec.num_kv_heads, head_dim)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The element type of the K/V cache tensors."""
        return torch.uint8 if self.quantized else self.dtype

    def quant_format(self, head_dim: int) -> kv_quant.KVQuantFormat:
        """The quantized row format of K (``head_dim``) or V (``v_head_dim``) rows."""
        if not self.quantized:
            raise ValueError("the KV cache is not quantized")
        return kv_quant.KVQuantFormat(self.kv_dtype, self.spec.num_kv_heads, head_dim, self.row_bytes(head_dim))

    @property
    def bytes_per_token(self) -> int:
        """Physical KV bytes of one token over every layer (quantized: codes, scales and padding)."""
        s = self.spec
        return s.num_layers * (self.row_bytes(s.head_dim) + (self.row_bytes(s.v_head_dim) if s.v_head_dim else 0))

    @property
    def fingerprint(self) -> str:
        """What two engines must share for one to use the other's KV pages: layers, KV heads, K and V
        widths, the stored format and block size (e.g. ``30L3H64K64V/bfloat16/32``; quantized: the kind and
        the K row's bytes, ``30L3H64K64V/int8@208/256``)."""
        s = self.spec
        dtype = str(self.dtype).removeprefix("torch.")
        if self.quantized:
            dtype = f"{self.kv_dtype}@{self.row_bytes(s.head_dim)}"
        return f"{s.num_layers}L{s.num_kv_heads}H{s.head_dim}K{s.v_head_dim}V/{dtype}/{self.block_size}"


@dataclass(frozen=True)
class PrefixStats:
    """Cumulative prefix-cache lookups of a backend: prompt tokens looked up and found cached
    (first admissions only; a preempted sequence's re-admission is not a new query)."""

    queries: int = 0
    hits: int = 0
