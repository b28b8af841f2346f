"""Contiguous KV: one max-length region per sequence slot, reserved up front.

Per layer K and V are ``[max_num_seqs, max_model_len, kv_heads, head_dim]`` (a quantized
cache: ``uint8 [max_num_seqs, max_model_len, row_bytes]``)
allocated with ``torch.empty`` (the OS commits pages only when first written).
Block accounting bounds how many tokens may be live at once. This is the
baseline the xTensor and paged backends are measured against.
"""

from __future__ import annotations

import torch

from xllm.core.kv.addressing_quant import slot_addressing
from xllm.core.kv.base import KVCacheBackend
from xllm.core.kv.layout import KVCacheLayout


class ContiguousKVCache(KVCacheBackend):
    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        self.addressing = slot_addressing(self, layout)
        spec = layout.spec
        shape, dtype = (layout.max_num_seqs, layout.max_model_len), layout.cache_dtype
        self.k = [torch.empty(*shape, *layout.row_shape(spec.head_dim), dtype=dtype, device=layout.device)
                  for _ in range(spec.num_layers)]
        self.v = [torch.empty(*shape, *layout.row_shape(spec.v_head_dim), dtype=dtype, device=layout.device)
                  if spec.v_head_dim else None for _ in range(spec.num_layers)]
        self._free_slots = list(range(layout.max_num_seqs - 1, -1, -1))
        self._blocks: dict[int, int] = {}  # slot -> blocks held
        self._free_blocks = layout.num_blocks

    def allocate(self, seq, num_new_tokens: int) -> bool:
        target = seq.num_computed_tokens + num_new_tokens
        if target > self.layout.max_model_len:
            return False
        need = self.layout.blocks_for(target)
        if seq.slot is None:
            if not self._free_slots or need > self._free_blocks:
                return False
            seq.slot = self._free_slots.pop()
            self._blocks[seq.slot] = 0
        extra = need - self._blocks[seq.slot]
        if extra > self._free_blocks:
            return False
        if extra > 0:
            self._blocks[seq.slot] = need
            self._free_blocks -= extra
        return True

    def free(self, seq) -> None:
        if seq.slot is None:
            return
        self._free_blocks += self._blocks.pop(seq.slot)
        self._free_slots.append(seq.slot)
        seq.slot = None

    def layer_kv(self, layer: int):
        return self.k[layer], self.v[layer]

    @property
    def num_free_blocks(self) -> int:
        return self._free_blocks
