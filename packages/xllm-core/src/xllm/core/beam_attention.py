"""Attention for beam groups: the prompt's KV once per group, each beam's own decoded KV per beam.

A beam group's prompt (history) KV stays where the prefill put it: the sequence's slot (xTensor,
contiguous) or pages (paged), shared by every beam and never copied. Each beam's decoded tokens
have their KV in :class:`BeamKV`, a small buffer ``[layers, W, max_tokens, kv_heads, dim]`` outside
the page pool (a beam keeps only its own decoded tokens: a 3-token item needs 3 rows per beam).

For one group with ``B`` beams at decode step ``t`` the attention of a layer is
(:class:`BeamAttention`): the ``B x G`` queries of each KV head against the ``P`` prompt keys as one
GEMM (the shared part once per group), against each beam's ``t + 1`` own keys (the beam part per
beam), then the two softmax parts merged by their log-sum-exp. fp32 throughout. A quantized KV cache
(``--kv-cache-dtype``) has its prompt rows decoded per layer and step (the beams' own rows are kept in
the model's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xllm.core.kv.addressing import SlotAddressing, values_in_keys
from xllm.core.kv.contracts import KVTensors
from xllm.kernels import kv_quant


class BeamKV:
    """The decoded tokens' KV of one group's beams (row ``b`` is live beam ``b``). ``key`` names the group
    to a tensor-parallel instance's workers, which mirror the buffer with their own KV heads
    (:mod:`xllm.core.beam_mirror`); :attr:`reordered` is the last :meth:`reorder` they have not seen yet."""

    def __init__(self, layers: int, width: int, max_tokens: int, kv_heads: int, head_dim: int,
                 v_head_dim: int, dtype: torch.dtype, key: int = 0) -> None:
        self.k = torch.empty(layers, width, max_tokens, kv_heads, head_dim, dtype=dtype)
        self.v = torch.empty(layers, width, max_tokens, kv_heads, v_head_dim, dtype=dtype) if v_head_dim else None
        self.key = key
        self.reordered: tuple[list[int], int] = ([], 0)  # (parents, length) of the last reorder

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)

    def reorder(self, parents: torch.Tensor, length: int) -> None:
        """New beam ``b`` continues old beam ``parents[b]``: its first ``length`` rows become those
        of its parent (the only copy beam search makes: decoded rows, never the prompt's)."""
        if length == 0 or not len(parents):
            return
        self.reordered = (parents.tolist(), length)
        n = len(parents)
        for buf in (self.k, self.v):
            if buf is not None:
                buf[:, :n, :length] = buf[:, parents, :length]

    def take_reordered(self) -> tuple[list[int], int]:
        """The last :meth:`reorder`'s ``(parents, length)`` not taken yet (``([], 0)``: none), taken."""
        out, self.reordered = self.reordered, ([], 0)
        return out


@dataclass
class GroupRows:
    """One group's rows in a beam step: rows ``[start, start + beams)`` of the packed batch, its
    prompt KV (``prompt_len`` tokens in slot ``slot`` or pages ``pages``), its beams' buffer and the
    index of this step's token in it."""

    start: int
    beams: int
    prompt_len: int
    slot: int | None
    pages: list[int]
    kv: BeamKV
    step: int


class BeamAttention:
    """The :class:`~xllm.core.model_api.AttentionContext` of a beam step over ``groups``."""

    def __init__(self, backend: KVTensors, groups: list[GroupRows]) -> None:
        self.backend = backend
        self.groups = groups
        # per-slot regions (xTensor, contiguous; quantized ones too, of token rows) or page pools (paged)
        self.by_slot = isinstance(backend.addressing, SlotAddressing)
        self._page_rows: dict[int, torch.Tensor] = {}  # group index -> page-pool rows of its prompt (paged)

    def _prompt_kv(self, gi: int, g: GroupRows, layer: int, v_dim: int | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.backend.layout
        k_cache, v_cache = self.backend.layer_kv(layer)
        if layout.quantized:  # uint8 token rows: decoded to [P, H, D]
            k = self._rows(gi, g, k_cache)
            k = kv_quant.decode_rows(k, layout.quant_format(layout.spec.head_dim))
            if v_cache is None:
                return k, values_in_keys(k, v_dim)
            return k, kv_quant.decode_rows(self._rows(gi, g, v_cache), layout.quant_format(layout.spec.v_head_dim))
        if v_cache is None:
            v_cache = values_in_keys(k_cache, v_dim)
        return self._rows(gi, g, k_cache), self._rows(gi, g, v_cache)

    def _rows(self, gi: int, g: GroupRows, cache: torch.Tensor) -> torch.Tensor:
        """The prompt's rows of one layer's K or V: a view of the slot (no copy), or gathered pages."""
        if self.by_slot:  # [slots, max_len, ...]
            return cache[g.slot, :g.prompt_len]
        rows = self._page_rows.get(gi)
        if rows is None:
            bs = cache.shape[1]
            pos = torch.arange(g.prompt_len)
            rows = torch.tensor(g.pages, dtype=torch.int64)[pos // bs] * bs + pos % bs
            self._page_rows[gi] = rows
        return cache.flatten(0, 1)[rows]

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                  scale: float, v_dim: int | None = None) -> torch.Tensor:
        heads, dim = q.shape[1], q.shape[2]
        out = torch.empty(q.shape[0], heads, v_dim or (v.shape[2] if v is not None else dim), dtype=q.dtype)
        for gi, g in enumerate(self.groups):
            rows = slice(g.start, g.start + g.beams)
            bk = g.kv.k[layer]
            bk[:g.beams, g.step] = k[rows]
            if g.kv.v is not None:
                g.kv.v[layer][:g.beams, g.step] = v[rows]
                bv = g.kv.v[layer]
            else:
                bv = values_in_keys(bk, v_dim)
            pk, pv = self._prompt_kv(gi, g, layer, v_dim)
            out[rows] = _group_attention(q[rows], pk, pv, bk[:g.beams, :g.step + 1], bv[:g.beams, :g.step + 1],
                                         scale).to(q.dtype)
        return out


def _group_attention(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, bk: torch.Tensor, bv: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """``q`` ``[B, H, D]``; prompt ``pk``/``pv`` ``[P, KVH, D|Dv]`` shared by all beams; own ``bk``/``bv``
    ``[B, t, KVH, D|Dv]``. Returns ``[B, H, Dv]`` (fp32)."""
    b, h, d = q.shape
    kvh = pk.shape[1]
    g = h // kvh
    qf = q.float().view(b, kvh, g, d)
    # shared part: every beam's queries of a KV head against the prompt's keys, one GEMM per head
    qs = qf.permute(1, 0, 2, 3).reshape(kvh, b * g, d)
    s1 = torch.bmm(qs, pk.float().permute(1, 2, 0)) * scale            # [KVH, B*G, P]
    m1 = s1.amax(dim=-1, keepdim=True)
    e1 = torch.exp(s1 - m1)
    l1 = e1.sum(dim=-1, keepdim=True)
    o1 = torch.bmm(e1, pv.float().permute(1, 0, 2))                    # [KVH, B*G, Dv]
    dv = o1.shape[-1]
    m1 = m1.view(kvh, b, g, 1).permute(1, 0, 2, 3)                    # [B, KVH, G, 1]
    l1 = l1.view(kvh, b, g, 1).permute(1, 0, 2, 3)
    o1 = o1.view(kvh, b, g, dv).permute(1, 0, 2, 3)
    # each beam's own decoded tokens
    s2 = torch.einsum("bhgd,bthd->bhgt", qf, bk.float()) * scale      # [B, KVH, G, t]
    m2 = s2.amax(dim=-1, keepdim=True)
    e2 = torch.exp(s2 - m2)
    l2 = e2.sum(dim=-1, keepdim=True)
    o2 = torch.einsum("bhgt,bthd->bhgd", e2, bv.float())
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    o = (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)
    return o.reshape(b, h, dv)
