"""Attention over the KV cache: contiguous (slot, length) addressing and paged block tables.

Contiguous layout (xTensor and the contiguous backend): one tensor per layer
for K and one for V, ``[num_slots, max_len, kv_heads, head_dim]``. A sequence
owns slot ``s``; its token at position ``p`` lives at ``[s, p]``. The kernels
read only ``[s, :length]``, so memory past a sequence's length may be unmapped
or stale. No block table: a sequence is addressed by a base offset and a length.

Paged layout (the fallback): pools ``[num_blocks, block_size, kv_heads,
head_dim]`` and a block table per sequence; token ``p`` lives at
``[table[p // block_size], p % block_size]``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          causal: bool, scale: float) -> torch.Tensor:
    """q ``[B, H, n, D]``, k/v ``[B, KVH, L, D]`` -> ``[B, H, n, Dv]`` with GQA (SDPA's own ``enable_gqa``:
    no repeated copy of K/V; the same values as repeating them)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads not divisible by {kv_heads} KV heads")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=heads != kv_heads)


def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's chunk: ``q`` ``[n, H, D]`` over its whole context ``k``/``v``
    ``[ctx, KVH, D]`` whose last ``n`` rows are the chunk itself (causal)."""
    n, ctx = q.shape[0], k.shape[0]
    offset = ctx - n
    qi, ki, vi = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if offset == 0:
        o = _sdpa(qi, ki, vi, None, n > 1, scale)
    else:
        rows = torch.arange(n, device=q.device).unsqueeze(1) + offset
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
        o = _sdpa(qi, ki, vi, mask, False, scale)
    return o[0].transpose(0, 1)


def _attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_lens: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """``q`` ``[B, H, D]`` over gathered ``k``/``v`` ``[B, L, KVH, D]`` (a copy) whose
    rows past each sequence's length are ignored."""
    max_len = k.shape[1]
    if k.shape[0] == 1:  # one sequence: its length is max_len, nothing to mask
        return _sdpa(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), None, False, scale).squeeze(2)
    valid = torch.arange(max_len, device=context_lens.device).unsqueeze(0) < context_lens.unsqueeze(1)
    # Rows past a length hold stale memory (possibly NaN bit patterns); a masked NaN
    # still poisons softmax(QK^T)V (0 * NaN = NaN), so zero them in the copy.
    invalid = ~valid[:, :, None, None]
    k = k.masked_fill_(invalid, 0).transpose(1, 2)
    v = v.masked_fill_(invalid, 0).transpose(1, 2)
    return _sdpa(q.unsqueeze(2), k, v, valid[:, None, None, :], False, scale).squeeze(2)


IntList = Sequence[int] | torch.Tensor


def _as_list(values: IntList) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def _as_index(values: IntList) -> torch.Tensor:
    """An int64 CPU tensor of ``values`` (no copy when it already is one and contiguous)."""
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.int64 and values.is_cpu and values.is_contiguous():
            return values
        return values.to(device="cpu", dtype=torch.int64).contiguous()
    return torch.tensor(values, dtype=torch.int64)


_NATIVE_DTYPES = (torch.bfloat16, torch.float32)


def _heads_packed(t: torch.Tensor) -> bool:
    """Rows of ``t`` (``[..., heads, dim]``) hold their heads back to back (unit inner stride)."""
    stride, shape = t.stride(), t.shape
    return stride[-1] == 1 and (shape[-2] == 1 or stride[-2] == shape[-1])


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: IntList,
    query_starts: IntList,
    context_lens: IntList,
    scale: float,
) -> torch.Tensor:
    """Causal attention for a packed batch of prompt chunks (varlen), contiguous KV.

    ``q`` is ``[T, H, D]`` with sequence ``i``'s ``n_i`` query rows at
    ``[query_starts[i], query_starts[i] + n_i)`` (``query_starts`` has one more
    entry than sequences: the end offset; ``n_i == 1`` rows are fine). The chunk's keys are
    already written to the cache; sequence ``i`` attends to ``[slot_i, :context_lens[i]]``, the
    last ``n_i`` of which are the chunk itself. Returns ``[T, H, Dv]``. The index arguments are
    int lists or int64 tensors (tensors avoid a conversion per call when reused across layers).

    On CPU with bf16/fp32 tensors whose heads are packed within a row (``q`` rows may be strided,
    e.g. views of a fused qkv projection) one native call attends every chunk
    (``kernels/cpu/attend_varlen.h``); otherwise each chunk goes through torch SDPA.
    """
    out = _native_prefill_attention(q, k_cache, v_cache, slots, query_starts, context_lens, scale)
    if out is not None:
        return out
    return _sdpa_prefill_attention(q, k_cache, v_cache, slots, query_starts, context_lens, scale)


def _sdpa_prefill_attention(q, k_cache, v_cache, slots, query_starts, context_lens, scale) -> torch.Tensor:
    """The torch path of :func:`prefill_attention`: one SDPA call per chunk."""
    slots, query_starts, context_lens = _as_list(slots), _as_list(query_starts), _as_list(context_lens)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    for i, slot in enumerate(slots):
        a, b = query_starts[i], query_starts[i + 1]
        ctx = context_lens[i]
        out[a:b] = _attend_chunk(q[a:b], k_cache[slot, :ctx], v_cache[slot, :ctx], scale)
    return out


def _native_prefill_attention(q, k_cache, v_cache, slots, query_starts, context_lens,
                              scale) -> torch.Tensor | None:
    """The native varlen kernel reading each sequence's KV in place, when it applies."""
    from xllm.kernels import native

    dtype = q.dtype
    if dtype not in _NATIVE_DTYPES or k_cache.dtype != dtype or v_cache.dtype != dtype:
        return None
    if not (q.is_cpu and k_cache.is_cpu) or q.dim() != 3 or torch.compiler.is_compiling():
        return None
    if not (_heads_packed(q) and _heads_packed(k_cache) and _heads_packed(v_cache)):
        return None
    lib = native.library()
    if lib is None:
        return None
    rows, heads, dim = q.shape
    kv_heads, dv = k_cache.shape[2], v_cache.shape[-1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads not divisible by {kv_heads} KV heads")
    slots_t, starts_t, ctx_t = _as_index(slots), _as_index(query_starts), _as_index(context_lens)
    out = torch.empty(rows, heads, dv, dtype=dtype)
    sfx = native.suffix(dtype)
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.fn(f"xllm_varlen_attention_{sfx}", [vp, i64, vp, vp, i64, i64, i64, i64, vp, vp, vp, i64, i64, i64, i64,
                                                 i64, ctypes.c_float, vp, i64])
    fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
       v_cache.stride(0), v_cache.stride(1), slots_t.data_ptr(), starts_t.data_ptr(), ctx_t.data_ptr(),
       len(slots_t), heads, kv_heads, dim, dv, float(scale), out.data_ptr(), out.stride(0))
    return out


def write_kv_rows(k_cache: torch.Tensor, v_cache: torch.Tensor | None, slots: torch.Tensor, positions: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor | None) -> None:
    """Store token rows ``k`` ``[T, KVH, D]`` (and ``v`` ``[T, KVH, Dv]``) at
    ``k_cache[slots[t], positions[t]]`` (``v_cache`` likewise); ``v_cache`` or ``v`` None stores
    keys only (a latent cache). ``slots``/``positions`` are int64 ``[T]``. Same result as
    ``k_cache[slots, positions] = k``; on CPU with bf16/fp32 and heads packed within rows (``k``/``v``
    rows may be strided) a native row copy replaces the index_put."""
    if not _native_write_kv_rows(k_cache, v_cache, slots, positions, k, v):
        k_cache[slots, positions] = k
        if v_cache is not None and v is not None:
            v_cache[slots, positions] = v


def _native_write_kv_rows(k_cache, v_cache, slots, positions, k, v) -> bool:
    """The native row copy when it applies (checks kept cheap: this runs once per layer)."""
    from xllm.kernels import native

    dtype = k_cache.dtype
    if dtype not in _NATIVE_DTYPES or k.dtype != dtype or not (k_cache.is_cpu and k.is_cpu):
        return False
    values = v_cache is not None and v is not None
    rows, kv_heads, dim = k.shape
    if k_cache.shape[2:] != k.shape[1:] or not (_heads_packed(k_cache) and _heads_packed(k)):
        return False
    if values and (v.dtype != dtype or v_cache.dtype != dtype or not v.is_cpu or v_cache.shape[2:] != v.shape[1:]
                   or not (_heads_packed(v_cache) and _heads_packed(v))):
        return False
    if len(slots) != rows or len(positions) != rows or torch.compiler.is_compiling():
        return False
    lib = native.library()
    if lib is None:
        return False
    slots, positions = _as_index(slots), _as_index(positions)
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.fn(f"xllm_write_kv_rows_{native.suffix(dtype)}", [vp, vp, i64, i64, i64, i64, vp, vp, i64, vp, vp, i64,
                                                              i64, i64, i64, i64])
    ks = k_cache.stride()
    if values:
        vs = v_cache.stride()
        fn(k_cache.data_ptr(), v_cache.data_ptr(), ks[0], ks[1], vs[0], vs[1], slots.data_ptr(), positions.data_ptr(),
           rows, k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), kv_heads, dim, v.shape[2])
    else:
        fn(k_cache.data_ptr(), None, ks[0], ks[1], 0, 0, slots.data_ptr(), positions.data_ptr(), rows, k.data_ptr(),
           None, k.stride(0), 0, kv_heads, dim, 0)
    return True


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence over contiguous KV: ``q`` ``[B, H, D]`` -> ``[B, H, Dv]``.

    Sequence ``b`` attends to ``[slots[b], :context_lens[b]]``. The new token's K/V
    are either already in the cache or given as ``k_new``/``v_new`` ``[B, KVH, D]``
    and stored at position ``context_lens[b] - 1`` first (``v_new`` None with
    ``v_cache`` a view of the keys: a latent cache). ``slots`` and
    ``context_lens`` are int64 ``[B]``.
    """
    out = _native_decode_attention(q, k_cache, v_cache, slots, context_lens, scale, k_new, v_new)
    if out is not None:
        return out
    if k_new is not None:
        pos = context_lens - 1
        k_cache[slots, pos] = k_new
        if v_new is not None:
            v_cache[slots, pos] = v_new
    max_len = int(context_lens.max())
    return _attend_decode(q, k_cache[slots, :max_len], v_cache[slots, :max_len], context_lens, scale)


def _native_decode_attention(q, k_cache, v_cache, slots, context_lens, scale, k_new=None,
                             v_new=None) -> torch.Tensor | None:
    """The C kernel reading each sequence's KV in place (no gather copy), when it applies."""
    from xllm.kernels import native

    dtype = q.dtype
    if dtype not in (torch.bfloat16, torch.float32) or k_cache.dtype != dtype or v_cache.dtype != dtype:
        return None
    if q.device.type != "cpu" or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return None
    if k_cache.stride(2) != k_cache.shape[3] or (v_cache.shape[2] > 1 and v_cache.stride(2) != v_cache.shape[3]):
        return None  # heads must be packed within a token row
    lib = native.library()
    if lib is None:
        return None
    if (k_new is not None and (k_new.dtype != dtype or not k_new.is_contiguous())) or \
            (v_new is not None and (v_new.dtype != dtype or not v_new.is_contiguous())):
        return None
    q = q.contiguous()
    bsz, heads, dim = q.shape
    kv_heads, dv = k_cache.shape[2], v_cache.shape[-1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads not divisible by {kv_heads} KV heads")
    out = torch.empty(bsz, heads, dv, dtype=dtype)
    slots = slots.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    fn = lib.lib.xllm_decode_attention_bf16 if dtype == torch.bfloat16 else lib.lib.xllm_decode_attention_f32
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
       v_cache.stride(0), v_cache.stride(1), slots.data_ptr(), lens.data_ptr(), bsz, heads, kv_heads, dim, dv,
       float(scale), None if k_new is None else k_new.data_ptr(), None if v_new is None else v_new.data_ptr(),
       out.data_ptr())
    return out


def paged_write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None,
                   slot_mapping: torch.Tensor) -> None:
    """Write token rows ``k``/``v`` ``[T, KVH, D]`` at flat pool rows ``slot_mapping``
    (``page * block_size + offset``, int64 ``[T]``)."""
    k_pool.view(-1, *k_pool.shape[2:])[slot_mapping] = k
    if v_pool is not None and v is not None:
        v_pool.view(-1, *v_pool.shape[2:])[slot_mapping] = v


def _gather_pages(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Token rows ``[:length]`` of a sequence from its block table (a copy)."""
    return pool[table].flatten(0, 1)[:length]


def paged_prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: list[torch.Tensor],
    query_starts: list[int],
    context_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """:func:`prefill_attention` over paged KV; ``block_tables[i]`` is int64 ``[num_blocks_i]``."""
    out = q.new_empty(q.shape[0], q.shape[1], v_pool.shape[-1])
    for i, table in enumerate(block_tables):
        a, b = query_starts[i], query_starts[i + 1]
        ctx = context_lens[i]
        out[a:b] = _attend_chunk(q[a:b], _gather_pages(k_pool, table, ctx), _gather_pages(v_pool, table, ctx), scale)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`decode_attention` over paged KV; ``block_tables`` is int64 ``[B, max_blocks]``
    (rows padded with any valid page id)."""
    max_len = int(context_lens.max())
    bsz = q.shape[0]
    k = k_pool[block_tables].view(bsz, -1, *k_pool.shape[2:])[:, :max_len]
    v = v_pool[block_tables].view(bsz, -1, *v_pool.shape[2:])[:, :max_len]
    return _attend_decode(q, k, v, context_lens, scale)
