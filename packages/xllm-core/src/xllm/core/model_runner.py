"""Turns a step plan into one model forward: packed inputs, attention over the KV
backend, and the logits of the sequences that sample this step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xllm.core.kv.base import KVCacheBackend
from xllm.core.model_api import CausalLM
from xllm.core.sequence import Sequence
from xllm.kernels import decode_attention, prefill_attention


@dataclass
class BatchInputs:
    """A packed step: decode tokens first (one per sequence), then prefill chunks.

    ``sample_rows[i]`` is the packed row whose hidden state yields the next
    token of ``sample_seqs[i]`` (the last row of a sequence that completes its
    known tokens this step).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    num_decode: int
    decode_slots: torch.Tensor
    decode_context_lens: torch.Tensor
    prefill_slots: list[int]
    prefill_query_starts: list[int]
    prefill_context_lens: list[int]
    token_slots: torch.Tensor
    sample_rows: torch.Tensor
    sample_seqs: list[Sequence]


class StepAttention:
    """:class:`~xllm.core.model_api.AttentionContext` for one step over a KV backend."""

    def __init__(self, kv: KVCacheBackend, batch: BatchInputs) -> None:
        self.kv = kv
        self.batch = batch

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
        b = self.batch
        k_cache, v_cache = self.kv.layer_kv(layer)
        k_cache[b.token_slots, b.positions] = k
        if v_cache is not None and v is not None:
            v_cache[b.token_slots, b.positions] = v
        nd = b.num_decode
        parts = []
        if nd:
            parts.append(decode_attention(q[:nd], k_cache, v_cache, b.decode_slots, b.decode_context_lens, scale))
        if b.prefill_slots:
            parts.append(prefill_attention(q[nd:], k_cache, v_cache, b.prefill_slots,
                                           b.prefill_query_starts, b.prefill_context_lens, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class ModelRunner:
    """Runs ``model`` on scheduled chunks with KV from ``kv``."""

    def __init__(self, model: CausalLM, kv: KVCacheBackend, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.device = device

    def prepare(self, chunks: list[tuple[Sequence, int]]) -> BatchInputs:
        """Pack ``(seq, num_tokens)`` chunks; decodes must come first."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        num_decode = 0
        dec_slots: list[int] = []
        dec_lens: list[int] = []
        pf_slots: list[int] = []
        pf_starts: list[int] = []
        pf_lens: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for seq, n in chunks:
            start = seq.num_computed_tokens
            end = start + n
            is_decode = n == 1 and end == seq.num_tokens and start > 0
            if is_decode:
                if pf_slots:
                    raise ValueError("decode chunks must precede prefill chunks")
                num_decode += 1
                dec_slots.append(seq.slot)
                dec_lens.append(end)
            else:
                pf_slots.append(seq.slot)
                pf_starts.append(len(ids) - num_decode)
                pf_lens.append(end)
            ids.extend(seq.token_slice(start, end))
            pos.extend(range(start, end))
            slots.extend([seq.slot] * n)
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        pf_starts.append(len(ids) - num_decode)
        dev = self.device
        return BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            num_decode=num_decode,
            decode_slots=torch.tensor(dec_slots, dtype=torch.long, device=dev),
            decode_context_lens=torch.tensor(dec_lens, dtype=torch.long, device=dev),
            prefill_slots=pf_slots,
            prefill_query_starts=pf_starts,
            prefill_context_lens=pf_lens,
            token_slots=torch.tensor(slots, dtype=torch.long, device=dev),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            sample_seqs=sample_seqs,
        )

    @torch.inference_mode()
    def execute(self, batch: BatchInputs) -> torch.Tensor:
        """Forward the packed batch; float32 logits ``[len(sample_seqs), vocab]``."""
        hidden = self.model.forward(batch.input_ids, batch.positions, StepAttention(self.kv, batch))
        if not batch.sample_seqs:
            return hidden.new_empty(0, 0, dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.sample_rows])
