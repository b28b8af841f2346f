"""Paged KV (block tables): the fallback for platforms without virtual memory control.

Per layer, K and V are pools ``[num_blocks, block_size, kv_heads, head_dim]`` (quantized:
``uint8 [num_blocks, block_size, row_bytes]``);
a sequence's ``kv_pages`` is its block table. Same allocator and prefix cache as
xTensor; attention gathers through the block table.
"""

from __future__ import annotations

import torch

from xllm.core.kv.addressing_quant import page_addressing
from xllm.core.kv.layout import KVCacheLayout
from xllm.core.kv.page_store import PageStore
from xllm.core.kv.prefix import PrefixCachingBackend


class PagedKVCache(PrefixCachingBackend):
    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        self.addressing = page_addressing(self, layout)
        spec = layout.spec
        shape, dtype = (layout.num_blocks, layout.block_size), layout.cache_dtype
        self.k = [torch.zeros(*shape, *layout.row_shape(spec.head_dim), dtype=dtype, device=layout.device)
                  for _ in range(spec.num_layers)]
        self.v = [torch.zeros(*shape, *layout.row_shape(spec.v_head_dim), dtype=dtype, device=layout.device)
                  if spec.v_head_dim else None for _ in range(spec.num_layers)]

    def _attach(self, seq, hit_pages: list[int]) -> bool:
        return True

    def _detach(self, seq) -> None:
        pass

    def _new_page(self, seq, block: int, sync: bool = True) -> int | None:
        page = self.pool.take(seq.request_id)
        if page is None:
            return None
        self.pool.mark_mapped(page.page_id)
        return page.page_id

    def layer_kv(self, layer: int):
        return self.k[layer], self.v[layer]

    def page_store(self) -> PageStore:
        pools = [(layer, t) for layer in range(self.layout.spec.num_layers) for t in (self.k[layer], self.v[layer])
                 if t is not None]
        buffers = tuple(memoryview(t.view(torch.uint8).numpy()).cast("B") for _, t in pools)
        return PageStore(self.layout.fingerprint, buffers, tuple(t[0].nbytes for _, t in pools),
                         tuple(layer for layer, _ in pools))

    def release_memory(self) -> int:
        """Free the K/V pools' storage (engine sleep; no sequence holds KV); the tensors keep their shapes and
        get zeroed storage back in :meth:`restore_memory`. Returns the bytes freed."""
        freed = 0
        for t in (*self.k, *self.v):
            if t is not None and t.untyped_storage().nbytes():
                freed += t.untyped_storage().nbytes()
                t.untyped_storage().resize_(0)
        return freed

    def restore_memory(self) -> None:
        for t in (*self.k, *self.v):
            if t is not None and not t.untyped_storage().nbytes():
                t.untyped_storage().resize_(t.nbytes)
                t.zero_()

    def physical_bytes_in_use(self) -> int:
        return self.pool.num_in_use * self.bytes_per_page

    @property
    def bytes_per_page(self) -> int:
        return self.layout.block_size * self.layout.bytes_per_token
