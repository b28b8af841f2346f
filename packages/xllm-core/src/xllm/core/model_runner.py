"""Turns a step plan into one model forward: packed inputs, attention over the KV
backend, and the logits of the sequences that sample this step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from xllm.core.kv.base import KVCacheBackend
from xllm.core.model_api import CausalLM
from xllm.core.sequence import Sequence
from xllm.kernels import (
    decode_attention,
    paged_decode_attention,
    paged_prefill_attention,
    paged_write_kv,
    prefill_attention,
)


@dataclass
class BatchInputs:
    """A packed step: decode tokens first (one per sequence), then prefill chunks.

    ``sample_rows[i]`` is the packed row whose hidden state yields the next
    token of ``sample_seqs[i]`` (the last row of a sequence that completes its
    known tokens this step). Addressing fields are filled for the backend's
    kind: slots (contiguous views) or block tables (paged).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    num_decode: int
    decode_context_lens: torch.Tensor
    prefill_query_starts: list[int]
    prefill_context_lens: list[int]
    sample_rows: torch.Tensor
    sample_seqs: list[Sequence]
    # slot addressing
    token_slots: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    prefill_slots: list[int] = field(default_factory=list)
    # paged addressing
    slot_mapping: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    prefill_block_tables: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_prefill_seqs(self) -> int:
        return len(self.prefill_query_starts) - 1


class StepAttention:
    """:class:`~xllm.core.model_api.AttentionContext` over a slot-addressed backend."""

    def __init__(self, kv: KVCacheBackend, batch: BatchInputs) -> None:
        self.kv = kv
        self.batch = batch

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                  scale: float, v_dim: int | None = None) -> torch.Tensor:
        b = self.batch
        k_cache, v_cache = self.kv.layer_kv(layer)
        nd = b.num_decode
        latent = v_cache is None
        if latent:
            v_cache = _values_in_keys(k_cache, v_dim)
        if len(k) > nd:  # prefill rows: stored here; decode rows are stored by the decode kernel
            k_cache[b.token_slots[nd:], b.positions[nd:]] = k[nd:]
            if not latent and v is not None:
                v_cache[b.token_slots[nd:], b.positions[nd:]] = v[nd:]
        parts = []
        if nd:
            k_new = k[:nd].contiguous()
            v_new = None if latent or v is None else v[:nd].contiguous()
            parts.append(decode_attention(q[:nd], k_cache, v_cache, b.decode_slots, b.decode_context_lens, scale,
                                          k_new, v_new))
        if b.prefill_slots:
            parts.append(prefill_attention(q[nd:], k_cache, v_cache, b.prefill_slots,
                                           b.prefill_query_starts, b.prefill_context_lens, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _values_in_keys(k_cache: torch.Tensor, v_dim: int | None) -> torch.Tensor:
    """A latent cache's values: the first ``v_dim`` channels of the cached keys (a view)."""
    if v_dim is None:
        raise ValueError("a KV cache without values needs v_dim (the latent width)")
    return k_cache[..., :v_dim]


class PagedStepAttention(StepAttention):
    """:class:`~xllm.core.model_api.AttentionContext` over block tables."""

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                  scale: float, v_dim: int | None = None) -> torch.Tensor:
        b = self.batch
        k_pool, v_pool = self.kv.layer_kv(layer)
        paged_write_kv(k_pool, v_pool, k, v, b.slot_mapping)
        if v_pool is None:
            v_pool = _values_in_keys(k_pool, v_dim)
        nd = b.num_decode
        parts = []
        if nd:
            parts.append(paged_decode_attention(q[:nd], k_pool, v_pool, b.decode_block_tables,
                                                b.decode_context_lens, scale))
        if b.prefill_block_tables:
            parts.append(paged_prefill_attention(q[nd:], k_pool, v_pool, b.prefill_block_tables,
                                                 b.prefill_query_starts, b.prefill_context_lens, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class ModelRunner:
    """Runs ``model`` on scheduled chunks with KV from ``kv``."""

    def __init__(self, model: CausalLM, kv: KVCacheBackend, device: torch.device, native_decode: bool = True) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        # pure decode batches may run as one fused native call (models that offer ``fused_decode``)
        self.native_decode = native_decode and kv.slot_addressed and hasattr(model, "fused_decode")
        self.graph = None  # a CompiledDecode for larger decode batches (see graph_runner)
        self.mode_steps = {"native": 0, "compiled": 0, "eager": 0}

    @property
    def native_decode_steps(self) -> int:
        return self.mode_steps["native"]

    def prepare(self, chunks: list[tuple[Sequence, int]]) -> BatchInputs:
        """Pack ``(seq, num_tokens)`` chunks; decodes must come first."""
        ids: list[int] = []
        pos: list[int] = []
        num_decode = 0
        decode_seqs: list[Sequence] = []
        dec_lens: list[int] = []
        prefill_seqs: list[Sequence] = []
        pf_starts: list[int] = []
        pf_lens: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        token_seqs: list[tuple[Sequence, int]] = []
        for seq, n in chunks:
            start = seq.num_computed_tokens
            end = start + n
            if n == 1 and end == seq.num_tokens and start > 0:  # a decode token
                if prefill_seqs:
                    raise ValueError("decode chunks must precede prefill chunks")
                num_decode += 1
                decode_seqs.append(seq)
                dec_lens.append(end)
            else:
                prefill_seqs.append(seq)
                pf_starts.append(len(ids) - num_decode)
                pf_lens.append(end)
            ids.extend(seq.token_slice(start, end))
            pos.extend(range(start, end))
            token_seqs.append((seq, n))
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        pf_starts.append(len(ids) - num_decode)
        dev = self.device

        def tensor(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        batch = BatchInputs(
            input_ids=tensor(ids), positions=tensor(pos), num_decode=num_decode,
            decode_context_lens=tensor(dec_lens), prefill_query_starts=pf_starts, prefill_context_lens=pf_lens,
            sample_rows=tensor(sample_rows), sample_seqs=sample_seqs)
        if self.kv.slot_addressed:
            batch.token_slots = tensor([s.slot for s, n in token_seqs for _ in range(n)])
            batch.decode_slots = tensor([s.slot for s in decode_seqs])
            batch.prefill_slots = [s.slot for s in prefill_seqs]
        else:
            bs = self.kv.layout.block_size
            batch.slot_mapping = tensor([s.kv_pages[p // bs] * bs + p % bs
                                         for s, n in token_seqs
                                         for p in range(s.num_computed_tokens, s.num_computed_tokens + n)])
            if decode_seqs:
                width = max(len(s.kv_pages) for s in decode_seqs)
                batch.decode_block_tables = tensor([s.kv_pages + [s.kv_pages[0]] * (width - len(s.kv_pages))
                                                    for s in decode_seqs])
            batch.prefill_block_tables = [tensor(s.kv_pages) for s in prefill_seqs]
        return batch

    @torch.inference_mode()
    def execute(self, batch: BatchInputs) -> torch.Tensor:
        """Forward the packed batch; float32 logits ``[len(sample_seqs), vocab]``."""
        if batch.num_decode == len(batch.input_ids):  # a pure decode step: pick its graph mode
            if self.native_decode:
                hidden = self.model.fused_decode(batch.input_ids, batch.positions, batch.decode_slots,
                                                 self.kv.layer_kv)
                if hidden is not None:
                    self.mode_steps["native"] += 1
                    return self.model.compute_logits(hidden)
            if self.graph is not None and self.graph.covers(batch.num_decode):
                self.mode_steps["compiled"] += 1
                return self.graph(batch.input_ids, batch.positions, batch.decode_slots)
        self.mode_steps["eager"] += 1
        ctx = StepAttention(self.kv, batch) if self.kv.slot_addressed else PagedStepAttention(self.kv, batch)
        hidden = self.model.forward(batch.input_ids, batch.positions, ctx)
        if not batch.sample_seqs:
            return hidden.new_empty(0, 0, dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.sample_rows])
