"""How attention finds a sequence's KV: the addressing a KV backend gives the model runner.

Every backend owns one :class:`KVAddressing`. The model runner asks it to pack a step's
addresses (:meth:`KVAddressing.pack`) and for the step's attention context
(:meth:`KVAddressing.context`); it never looks at which kind of backend it has.

- :class:`SlotAddressing` (xTensor, contiguous): each sequence owns a slot ``seq.slot`` and
  ``layer_kv(layer)`` returns ``[slots, max_len, kv_heads, dim]`` tensors in which the sequence's
  tokens are rows ``[slot, 0:length]``. Attention reads them in place with (slot, length); fused
  native steps and compiled decode graphs need this view (fused steps also read quantized slot rows).
- :class:`PageAddressing` (paged): ``layer_kv(layer)`` returns page pools
  ``[num_blocks, block_size, kv_heads, dim]`` and ``seq.kv_pages`` is the block table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from xllm.core.model_api import AttentionContext
from xllm.kernels import (
    decode_attention,
    paged_decode_attention,
    paged_prefill_attention,
    paged_write_kv,
    prefill_attention,
)
from xllm.kernels.attention import write_kv_rows

if TYPE_CHECKING:
    from xllm.core.sequence import Sequence as Seq

Tensorize = Callable[[Sequence[int]], torch.Tensor]


class LayerKV(Protocol):
    """Where a backend keeps each layer's K and V (V is None for a latent cache)."""

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass
class SlotAddress:
    """A step's addresses under slot addressing."""

    token_slots: torch.Tensor    # slot of every packed token
    decode_slots: torch.Tensor   # slot of each decoding sequence
    prefill_slots: list[int]     # slot of each prefill chunk's sequence


@dataclass
class PageAddress:
    """A step's addresses under page addressing."""

    slot_mapping: torch.Tensor                # page-pool row (page * block_size + offset) of every packed token
    decode_block_tables: torch.Tensor | None  # [decodes, width], padded with each table's first page
    prefill_block_tables: list[torch.Tensor]


class PackedStep(Protocol):
    """What addressing reads of a packed step (the model runner's
    :class:`~xllm.core.model_runner.BatchInputs` is one; defined here so that no KV module imports
    the runner): decode rows first, then prefill chunks; ``address`` is what :meth:`KVAddressing.pack`
    gave for the step."""

    address: SlotAddress | PageAddress
    positions: torch.Tensor             # position of every packed row
    num_decode: int                     # decode rows (one per decoding sequence), first
    decode_context_lens: torch.Tensor   # context length of each decoding sequence after the step
    prefill_query_starts: list[int]     # prefill chunk row offsets within the prefill rows (one more than chunks)
    prefill_context_lens: list[int]     # context length of each chunk's sequence after the step


class KVAddressing(ABC):
    """The addressing of one backend (``kv``): packing a step's addresses and attending over them."""

    slot_views: ClassVar[bool] = False
    """Whether ``layer_kv`` gives per-slot contiguous views in the model dtype (what compiled decode graphs need)."""
    fused_steps: ClassVar[bool] = False
    """Whether ``layer_kv`` gives per-slot contiguous rows the fused native steps read (model-dtype views or
    quantized rows: :class:`~xllm.core.model_api.SlotKV`)."""

    def __init__(self, kv: LayerKV, block_size: int) -> None:
        self.kv = kv
        self.block_size = block_size

    @abstractmethod
    def pack(self, tokens: list[tuple[Seq, int]], decodes: list[Seq], prefills: list[Seq],
             tensor: Tensorize) -> SlotAddress | PageAddress:
        """Addresses for a step computing ``tokens`` (``(seq, n)`` chunks in packed order, before the
        step advances ``num_computed_tokens``); ``decodes``/``prefills`` are the chunks' sequences."""

    @abstractmethod
    def context(self, batch: PackedStep) -> AttentionContext:
        """The attention context of the packed step ``batch``."""

    def decode_slots(self, batch: PackedStep) -> torch.Tensor | None:
        """The slot of each decoding sequence when the backend has slot views, else None."""
        return None


class SlotAddressing(KVAddressing):
    slot_views = True
    fused_steps = True

    def pack(self, tokens, decodes, prefills, tensor) -> SlotAddress:
        return SlotAddress(token_slots=tensor([s.slot for s, n in tokens for _ in range(n)]),
                           decode_slots=tensor([s.slot for s in decodes]),
                           prefill_slots=[s.slot for s in prefills])

    def context(self, batch: PackedStep) -> SlotAttention:
        return SlotAttention(self.kv, batch)

    def decode_slots(self, batch: PackedStep) -> torch.Tensor:
        return batch.address.decode_slots


class PageAddressing(KVAddressing):
    def pack(self, tokens, decodes, prefills, tensor) -> PageAddress:
        bs = self.block_size
        mapping = tensor([s.kv_pages[p // bs] * bs + p % bs
                          for s, n in tokens for p in range(s.num_computed_tokens, s.num_computed_tokens + n)])
        tables = None
        if decodes:
            width = max(len(s.kv_pages) for s in decodes)
            tables = tensor([s.kv_pages + [s.kv_pages[0]] * (width - len(s.kv_pages)) for s in decodes])
        return PageAddress(mapping, tables, [tensor(s.kv_pages) for s in prefills])

    def context(self, batch: PackedStep) -> PagedAttention:
        return PagedAttention(self.kv, batch)


def values_in_keys(k_cache: torch.Tensor, v_dim: int | None) -> torch.Tensor:
    """A latent cache's values: the first ``v_dim`` channels of the cached keys (a view)."""
    if v_dim is None:
        raise ValueError("a KV cache without values needs v_dim (the latent width)")
    return k_cache[..., :v_dim]


class _StepAttention:
    """An :class:`~xllm.core.model_api.AttentionContext` for one packed step: decode rows first, then
    prefill chunks, whose outputs are concatenated in that order."""

    def __init__(self, kv: LayerKV, batch: PackedStep) -> None:
        self.kv = kv
        self.batch = batch

    @staticmethod
    def _join(parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class _PrefillIndex:
    """A step's prefill addresses as int64 tensors, built once and reused by every layer."""

    row_slots: torch.Tensor      # slot of each prefill row
    row_positions: torch.Tensor  # position of each prefill row
    slots: torch.Tensor          # slot of each prefill chunk's sequence
    query_starts: torch.Tensor   # chunk row offsets within the prefill rows (one more than chunks)
    context_lens: torch.Tensor   # context length of each chunk's sequence after the step


class SlotAttention(_StepAttention):
    """Attention over slot-addressed KV: reads each sequence's region in place."""

    def __init__(self, kv: LayerKV, batch: PackedStep) -> None:
        super().__init__(kv, batch)
        self._prefill: _PrefillIndex | None = None

    def _prefill_index(self) -> _PrefillIndex:
        if self._prefill is None:
            b, nd = self.batch, self.batch.num_decode
            index = torch.tensor
            self._prefill = _PrefillIndex(
                b.address.token_slots[nd:], b.positions[nd:], index(b.address.prefill_slots, dtype=torch.int64),
                index(b.prefill_query_starts, dtype=torch.int64), index(b.prefill_context_lens, dtype=torch.int64))
        return self._prefill

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                  scale: float, v_dim: int | None = None) -> torch.Tensor:
        b, addr = self.batch, self.batch.address
        k_cache, v_cache = self.kv.layer_kv(layer)
        nd = b.num_decode
        latent = v_cache is None
        if latent:
            v_cache = values_in_keys(k_cache, v_dim)
        pf = self._prefill_index() if len(k) > nd else None
        if pf is not None:  # prefill rows: stored here; decode rows are stored by the decode kernel
            values = not latent and v is not None
            write_kv_rows(k_cache, v_cache if values else None, pf.row_slots, pf.row_positions, k[nd:],
                          v[nd:] if values else None)
        parts = []
        if nd:
            k_new = k[:nd].contiguous()
            v_new = None if latent or v is None else v[:nd].contiguous()
            parts.append(decode_attention(q[:nd], k_cache, v_cache, addr.decode_slots, b.decode_context_lens, scale,
                                          k_new, v_new))
        if addr.prefill_slots:
            pf = self._prefill_index()
            parts.append(prefill_attention(q[nd:], k_cache, v_cache, pf.slots, pf.query_starts, pf.context_lens,
                                           scale))
        return self._join(parts)


class PagedAttention(_StepAttention):
    """Attention over block tables (gathers each sequence's pages)."""

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                  scale: float, v_dim: int | None = None) -> torch.Tensor:
        b, addr = self.batch, self.batch.address
        k_pool, v_pool = self.kv.layer_kv(layer)
        paged_write_kv(k_pool, v_pool, k, v, addr.slot_mapping)
        if v_pool is None:
            v_pool = values_in_keys(k_pool, v_dim)
        nd = b.num_decode
        parts = []
        if nd:
            parts.append(paged_decode_attention(q[:nd], k_pool, v_pool, addr.decode_block_tables,
                                                b.decode_context_lens, scale))
        if addr.prefill_block_tables:
            parts.append(paged_prefill_attention(q[nd:], k_pool, v_pool, addr.prefill_block_tables,
                                                 b.prefill_query_starts, b.prefill_context_lens, scale))
        return self._join(parts)
