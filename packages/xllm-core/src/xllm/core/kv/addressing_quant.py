"""Addressing of quantized KV caches (``--kv-cache-dtype int8|fp8_e4m3``).

The same packing as :class:`~xllm.core.kv.addressing.SlotAddressing` and
:class:`~xllm.core.kv.addressing.PageAddressing`; attention stores the step's K/V as quantized rows
and reads them through :mod:`xllm.kernels.attention_quant`. ``layer_kv`` gives ``uint8`` row tensors
(``[slots, max_len, row_bytes]`` or ``[num_blocks, block_size, row_bytes]``), not model-dtype
``[..., kv_heads, head_dim]`` views, so quantized slot addressing reports no ``slot_views``: no
compiled decode graph runs over it. The fused native steps read and write the quantized rows
themselves (``fused_steps``; ``kernels/cpu/llama_decode.h`` / ``llama_forward.h`` with
``XllmLlamaCfg.kv_quant``); steps they do not take, and paged quantized caches, run the eager
modules, whose attention is native here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xllm.core.kv.addressing import LayerKV, PageAddressing, PagedAttention, SlotAddressing, SlotAttention
from xllm.kernels.attention_quant import (
    decode_attention_q,
    paged_decode_attention_q,
    paged_prefill_attention_q,
    paged_write_kv_q,
    prefill_attention_q,
    write_kv_rows_q,
)
from xllm.kernels.kv_quant import KVQuantFormat

if TYPE_CHECKING:
    from xllm.core.kv.layout import KVCacheLayout


def _no_latent(v) -> None:
    if v is None:
        raise ValueError("quantized KV caches hold separate keys and values (latent caches are not implemented)")


class QuantSlotAddressing(SlotAddressing):
    """Slot addressing over quantized rows (K rows in format ``kf``, V rows in ``vf``)."""

    slot_views = False
    fused_steps = True

    def __init__(self, kv: LayerKV, block_size: int, kf: KVQuantFormat, vf: KVQuantFormat) -> None:
        super().__init__(kv, block_size)
        self.kf, self.vf = kf, vf

    def context(self, batch) -> QuantSlotAttention:
        return QuantSlotAttention(self.kv, batch, self.kf, self.vf)


class QuantSlotAttention(SlotAttention):
    """:class:`SlotAttention` over quantized slot caches."""

    def __init__(self, kv: LayerKV, batch, kf: KVQuantFormat, vf: KVQuantFormat) -> None:
        super().__init__(kv, batch)
        self.kf, self.vf = kf, vf

    def attention(self, layer, q, k, v, scale, v_dim=None):
        _no_latent(v)
        b, addr = self.batch, self.batch.address
        k_cache, v_cache = self.kv.layer_kv(layer)
        nd = b.num_decode
        if len(k) > nd:  # prefill rows: stored here; decode rows are stored by the decode kernel
            pf = self._prefill_index()
            write_kv_rows_q(k_cache, v_cache, pf.row_slots, pf.row_positions, k[nd:], v[nd:], self.kf, self.vf)
        parts = []
        if nd:
            parts.append(decode_attention_q(q[:nd], k_cache, v_cache, addr.decode_slots, b.decode_context_lens, scale,
                                            self.kf, self.vf, k[:nd].contiguous(), v[:nd].contiguous()))
        if addr.prefill_slots:
            pf = self._prefill_index()
            parts.append(prefill_attention_q(q[nd:], k_cache, v_cache, pf.slots, pf.query_starts, pf.context_lens,
                                             scale, self.kf, self.vf))
        return self._join(parts)


class QuantPageAddressing(PageAddressing):
    """Page addressing (block tables) over quantized pools."""

    def __init__(self, kv: LayerKV, block_size: int, kf: KVQuantFormat, vf: KVQuantFormat) -> None:
        super().__init__(kv, block_size)
        self.kf, self.vf = kf, vf

    def context(self, batch) -> QuantPagedAttention:
        return QuantPagedAttention(self.kv, batch, self.kf, self.vf)


class QuantPagedAttention(PagedAttention):
    """:class:`PagedAttention` over quantized pools (torch: gathers and dequantizes each sequence's pages)."""

    def __init__(self, kv: LayerKV, batch, kf: KVQuantFormat, vf: KVQuantFormat) -> None:
        super().__init__(kv, batch)
        self.kf, self.vf = kf, vf

    def attention(self, layer, q, k, v, scale, v_dim=None):
        _no_latent(v)
        b, addr = self.batch, self.batch.address
        k_pool, v_pool = self.kv.layer_kv(layer)
        paged_write_kv_q(k_pool, v_pool, k, v, addr.slot_mapping, self.kf, self.vf)
        nd = b.num_decode
        parts = []
        if nd:
            parts.append(paged_decode_attention_q(q[:nd], k_pool, v_pool, addr.decode_block_tables,
                                                  b.decode_context_lens, scale, self.kf, self.vf))
        if addr.prefill_block_tables:
            parts.append(paged_prefill_attention_q(q[nd:], k_pool, v_pool, addr.prefill_block_tables,
                                                   b.prefill_query_starts, b.prefill_context_lens, scale, self.kf,
                                                   self.vf))
        return self._join(parts)


def slot_addressing(kv: LayerKV, layout: KVCacheLayout) -> SlotAddressing:
    """The slot addressing of a backend with ``layout`` (quantized or not)."""
    if not layout.quantized:
        return SlotAddressing(kv, layout.block_size)
    s = layout.spec
    return QuantSlotAddressing(kv, layout.block_size, layout.quant_format(s.head_dim),
                               layout.quant_format(s.v_head_dim))


def page_addressing(kv: LayerKV, layout: KVCacheLayout) -> PageAddressing:
    """The page addressing of a backend with ``layout``."""
    if not layout.quantized:
        return PageAddressing(kv, layout.block_size)
    s = layout.spec
    return QuantPageAddressing(kv, layout.block_size, layout.quant_format(s.head_dim),
                               layout.quant_format(s.v_head_dim))
