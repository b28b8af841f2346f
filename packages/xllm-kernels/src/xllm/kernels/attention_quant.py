"""Attention over quantized KV caches (``--kv-cache-dtype int8|fp8_e4m3``; rows: :mod:`xllm.kernels.kv_quant`).

The same contracts as :mod:`xllm.kernels.attention`, with caches of quantized rows instead of
``[..., kv_heads, head_dim]`` tensors of the model dtype:

- slot addressing (xTensor, contiguous): ``uint8 [slots, max_len, row_bytes]``, a sequence's
  token ``p`` at ``[slot, p]``; on CPU with bf16/fp32 queries and head widths divisible by 16 the
  native kernels (``kernels/cpu/kv_quant.c``) quantize stored rows and dequantize inside attention,
  otherwise the torch path here dequantizes the context to fp32 and runs SDPA (the reference the
  native kernels are tested against);
- paged (block tables): ``uint8 [num_blocks, block_size, row_bytes]``, torch only (gathers the
  pages, dequantizes, attends), like the paged backend's unquantized path.

Keys and values have their own :class:`~xllm.kernels.kv_quant.KVQuantFormat` (``kf``/``vf``).
Attention math is fp32 over the dequantized values; outputs are cast to ``q``'s dtype.
"""

from __future__ import annotations

import ctypes

import torch

from xllm.kernels.attention import IntList, _as_index, _as_list, _attend_chunk, _attend_decode, _heads_packed
from xllm.kernels.kv_quant import KVQuantFormat, decode_rows, encode_rows

_NATIVE_DTYPES = (torch.bfloat16, torch.float32)


def _native_lib(q: torch.Tensor, caches: tuple[torch.Tensor, ...], kf: KVQuantFormat, vf: KVQuantFormat):
    """The native library when the quantized kernels apply to these tensors, else None."""
    from xllm.kernels import native

    if q.dtype not in _NATIVE_DTYPES or not q.is_cpu or torch.compiler.is_compiling():
        return None
    if kf.head_dim % 16 or vf.head_dim % 16 or kf.head_dim > 512 or vf.head_dim > 512:
        return None
    if any(c.dtype != torch.uint8 or c.dim() != 3 or c.stride(-1) != 1 or not c.is_cpu for c in caches):
        return None
    return native.library()


def _vp(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


# ---- slot addressing -------------------------------------------------------------------------------------
def write_kv_rows_q(k_cache: torch.Tensor, v_cache: torch.Tensor | None, slots: torch.Tensor,
                    positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, kf: KVQuantFormat,
                    vf: KVQuantFormat) -> None:
    """Quantize token rows ``k`` ``[T, KVH, D]`` (and ``v``) and store them at ``(slots[t], positions[t])``
    of the quantized caches (``v_cache`` or ``v`` None: keys only)."""
    values = v_cache is not None and v is not None
    lib = _native_lib(k, (k_cache, v_cache) if values else (k_cache,), kf, vf)
    if lib is not None and _heads_packed(k) and (not values or (v.dtype == k.dtype and _heads_packed(v))):
        from xllm.kernels import native

        slots, positions = _as_index(slots), _as_index(positions)
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        fn = lib.fn(f"xllm_kvq_write_rows_{native.suffix(k.dtype)}",
                    [vp, vp, i64, i64, i64, i64, vp, vp, i64, vp, vp, i64, i64, i64, i64, i64, ctypes.c_int])
        ks = k_cache.stride()
        vs = v_cache.stride() if values else (0, 0, 0)
        fn(k_cache.data_ptr(), _vp(v_cache) if values else None, ks[0], ks[1], vs[0], vs[1], slots.data_ptr(),
           positions.data_ptr(), len(slots), k.data_ptr(), v.data_ptr() if values else None, k.stride(0),
           v.stride(0) if values else 0, kf.kv_heads, kf.head_dim, vf.head_dim if values else 0, int(kf.fp8))
        return
    k_cache[slots, positions] = encode_rows(k, kf)
    if values:
        v_cache[slots, positions] = encode_rows(v, vf)


def decode_attention_q(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       context_lens: torch.Tensor, scale: float, kf: KVQuantFormat, vf: KVQuantFormat,
                       k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~xllm.kernels.attention.decode_attention` over quantized slot caches: ``q`` ``[B, H, D]``
    -> ``[B, H, Dv]``; ``k_new``/``v_new`` ``[B, KVH, D]`` are quantized and stored at position
    ``context_lens[b] - 1`` first."""
    out = _native_decode_q(q, k_cache, v_cache, slots, context_lens, scale, kf, vf, k_new, v_new)
    if out is not None:
        return out
    if k_new is not None:
        pos = context_lens - 1
        k_cache[slots, pos] = encode_rows(k_new, kf)
        if v_new is not None:
            v_cache[slots, pos] = encode_rows(v_new, vf)
    max_len = int(context_lens.max())
    k = decode_rows(k_cache[slots, :max_len], kf)
    v = decode_rows(v_cache[slots, :max_len], vf)
    return _attend_decode(q.float(), k, v, context_lens, scale).to(q.dtype)


def _native_decode_q(q, k_cache, v_cache, slots, context_lens, scale, kf, vf, k_new, v_new) -> torch.Tensor | None:
    from xllm.kernels import native

    lib = _native_lib(q, (k_cache, v_cache), kf, vf)
    if lib is None:
        return None
    if any(t is not None and (t.dtype != q.dtype or not t.is_contiguous()) for t in (k_new, v_new)):
        return None
    q = q.contiguous()
    bsz, heads, dim = q.shape
    if heads % kf.kv_heads:
        raise ValueError(f"{heads} query heads not divisible by {kf.kv_heads} KV heads")
    out = torch.empty(bsz, heads, vf.head_dim, dtype=q.dtype)
    slots, lens = _as_index(slots), _as_index(context_lens)
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.fn(f"xllm_kvq_decode_attention_{native.suffix(q.dtype)}",
                [vp, vp, vp, i64, i64, i64, i64, vp, vp, i64, i64, i64, i64, i64, ctypes.c_float, vp, vp,
                 ctypes.c_int, vp])
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
       v_cache.stride(1), slots.data_ptr(), lens.data_ptr(), bsz, heads, kf.kv_heads, dim, vf.head_dim, float(scale),
       _vp(k_new), _vp(v_new), int(kf.fp8), out.data_ptr())
    return out


def prefill_attention_q(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: IntList,
                        query_starts: IntList, context_lens: IntList, scale: float, kf: KVQuantFormat,
                        vf: KVQuantFormat) -> torch.Tensor:
    """:func:`~xllm.kernels.attention.prefill_attention` (packed causal chunks over a cached prefix)
    over quantized slot caches whose rows for every chunk are already stored."""
    out = _native_prefill_q(q, k_cache, v_cache, slots, query_starts, context_lens, scale, kf, vf)
    if out is not None:
        return out
    slots, query_starts, context_lens = _as_list(slots), _as_list(query_starts), _as_list(context_lens)
    out = q.new_empty(q.shape[0], q.shape[1], vf.head_dim)
    for i, slot in enumerate(slots):
        a, b = query_starts[i], query_starts[i + 1]
        ctx = context_lens[i]
        k, v = decode_rows(k_cache[slot, :ctx], kf), decode_rows(v_cache[slot, :ctx], vf)
        out[a:b] = _attend_chunk(q[a:b].float(), k, v, scale).to(q.dtype)
    return out


def _native_prefill_q(q, k_cache, v_cache, slots, query_starts, context_lens, scale, kf, vf) -> torch.Tensor | None:
    from xllm.kernels import native

    lib = _native_lib(q, (k_cache, v_cache), kf, vf)
    if lib is None or q.dim() != 3 or not _heads_packed(q):
        return None
    rows, heads, dim = q.shape
    if heads % kf.kv_heads:
        raise ValueError(f"{heads} query heads not divisible by {kf.kv_heads} KV heads")
    slots_t, starts_t, ctx_t = _as_index(slots), _as_index(query_starts), _as_index(context_lens)
    out = torch.empty(rows, heads, vf.head_dim, dtype=q.dtype)
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.fn(f"xllm_kvq_varlen_attention_{native.suffix(q.dtype)}",
                [vp, i64, vp, vp, i64, i64, i64, i64, vp, vp, vp, i64, i64, i64, i64, i64, ctypes.c_float,
                 ctypes.c_int, vp, i64])
    fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
       v_cache.stride(0), v_cache.stride(1), slots_t.data_ptr(), starts_t.data_ptr(), ctx_t.data_ptr(), len(slots_t),
       heads, kf.kv_heads, dim, vf.head_dim, float(scale), int(kf.fp8), out.data_ptr(), out.stride(0))
    return out


# ---- paged (block tables; torch only) --------------------------------------------------------------------
def paged_write_kv_q(k_pool: torch.Tensor, v_pool: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None,
                     slot_mapping: torch.Tensor, kf: KVQuantFormat, vf: KVQuantFormat) -> None:
    """Quantize rows ``k``/``v`` ``[T, KVH, D]`` into flat pool rows ``slot_mapping``."""
    k_pool.view(-1, k_pool.shape[-1])[slot_mapping] = encode_rows(k, kf)
    if v_pool is not None and v is not None:
        v_pool.view(-1, v_pool.shape[-1])[slot_mapping] = encode_rows(v, vf)


def _gather(pool: torch.Tensor, table: torch.Tensor, length: int, fmt: KVQuantFormat) -> torch.Tensor:
    return decode_rows(pool[table].flatten(0, 1)[:length], fmt)


def paged_decode_attention_q(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                             context_lens: torch.Tensor, scale: float, kf: KVQuantFormat,
                             vf: KVQuantFormat) -> torch.Tensor:
    """:func:`decode_attention_q` over paged quantized pools (``block_tables`` int64 ``[B, max_blocks]``)."""
    max_len = int(context_lens.max())
    bsz = q.shape[0]
    k = decode_rows(k_pool[block_tables].view(bsz, -1, k_pool.shape[-1])[:, :max_len], kf)
    v = decode_rows(v_pool[block_tables].view(bsz, -1, v_pool.shape[-1])[:, :max_len], vf)
    return _attend_decode(q.float(), k, v, context_lens, scale).to(q.dtype)


def paged_prefill_attention_q(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                              block_tables: list[torch.Tensor], query_starts: list[int], context_lens: list[int],
                              scale: float, kf: KVQuantFormat, vf: KVQuantFormat) -> torch.Tensor:
    """:func:`prefill_attention_q` over paged quantized pools."""
    out = q.new_empty(q.shape[0], q.shape[1], vf.head_dim)
    for i, table in enumerate(block_tables):
        a, b = query_starts[i], query_starts[i + 1]
        ctx = context_lens[i]
        k, v = _gather(k_pool, table, ctx, kf), _gather(v_pool, table, ctx, vf)
        out[a:b] = _attend_chunk(q[a:b].float(), k, v, scale).to(q.dtype)
    return out
