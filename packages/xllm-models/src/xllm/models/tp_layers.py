"""Vocabulary-parallel layers of a tensor-parallel model: the input embedding and the LM head.

Rank ``r`` holds the vocabulary rows ``[start, end)`` of :func:`xllm.models.tp_plan.vocab_span`
(``ceil(V / n)`` rows per rank, the last fewer):

- :class:`VocabParallelEmbedding` (float) / :class:`QuantVocabParallelEmbedding` (quantized rows): a
  token outside the rank's rows looks up zeros, then the ranks' lookups are all-reduced (each token's
  row comes from exactly one rank, so the sum is the full lookup, bit for bit);
- :class:`VocabParallelHead` wraps the rank's LM head over its rows: ``logits`` all-gathers the ranks'
  logits (each padded to ``ceil(V / n)`` columns), concatenates them and cuts them to ``V``; ``greedy``
  all-gathers each rank's row maximum and its (global) index and takes the first rank holding the
  largest, which is ``logits(x).argmax(-1)`` exactly (first index on ties: ranks hold increasing ranges).

One-process models never build these (:func:`vocab_embedding`, :func:`parallel_head` return the plain
layers), so they run no extra work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from xllm.core.parallel.comm import Communicator
from xllm.kernels.quant import QuantizedWeight
from xllm.models.config import ModelConfig
from xllm.models.layers import LMHead, QuantEmbedding
from xllm.models.tensor_parallel import TPShard
from xllm.models.tp_plan import vocab_chunk


def _parallel_lookup(ids: torch.Tensor, start: int, rows: int, vocab: int, comm: Communicator,
                     lookup: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The full-vocabulary lookup of ``ids`` from each rank's ``rows`` rows starting at ``start``."""
    flat = ids.reshape(-1).long()
    if flat.numel():
        lo, hi = torch.aminmax(flat)
        if int(lo) < 0 or int(hi) >= vocab:
            raise IndexError(f"token id out of range [0, {vocab})")
    local = flat - start
    inside = (local >= 0) & (local < rows)
    out = lookup(torch.where(inside, local, torch.zeros_like(local)))
    out = out.masked_fill(~inside.unsqueeze(-1), 0)
    comm.all_reduce(out)
    return out.view(*ids.shape, out.shape[-1])


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[vocab_start, vocab_start + num_embeddings)`` of a ``full_vocab``-token embedding; the
    forward looks every id up (zeros outside the rows) and all-reduces over ``comm``: every rank gets the
    full lookup. ``weight`` is the local rows (the checkpoint's ``embed_tokens.weight`` sliced)."""

    def __init__(self, tp: TPShard, embedding_dim: int) -> None:
        super().__init__(tp.vocab.size, embedding_dim)
        self.vocab_start, self.full_vocab, self.comm = tp.vocab.start, tp.vocab_size, tp.comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return _parallel_lookup(input_ids, self.vocab_start, self.num_embeddings, self.full_vocab, self.comm,
                                lambda ids: F.embedding(ids, self.weight))

    def extra_repr(self) -> str:
        return f"rows {self.vocab_start}:{self.vocab_start + self.num_embeddings} of {self.full_vocab}, " \
               f"{self.embedding_dim}"


class QuantVocabParallelEmbedding(QuantEmbedding):
    """:class:`VocabParallelEmbedding` over quantized rows (a GGUF's embedding, or a tied one
    quantized at load)."""

    def __init__(self, qweight: QuantizedWeight, dtype: torch.dtype, vocab_start: int, full_vocab: int,
                 comm: Communicator) -> None:
        super().__init__(qweight, dtype)
        self.vocab_start, self.full_vocab, self.comm = vocab_start, full_vocab, comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return _parallel_lookup(input_ids, self.vocab_start, self.num_embeddings, self.full_vocab, self.comm,
                                super().forward)


def vocab_embedding(cfg: ModelConfig, tp: TPShard) -> nn.Embedding:
    """The input embedding of a model on ``tp``: plain when one process holds it all."""
    if not tp.parallel:
        return nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    return VocabParallelEmbedding(tp, cfg.hidden_size)


def quant_embedding(embedding: nn.Module, qweight: QuantizedWeight, dtype: torch.dtype) -> QuantEmbedding:
    """The quantized counterpart of ``embedding`` over ``qweight`` (its rows, quantized): vocabulary-
    parallel when ``embedding`` is."""
    if isinstance(embedding, (VocabParallelEmbedding, QuantVocabParallelEmbedding)):
        return QuantVocabParallelEmbedding(qweight, dtype, embedding.vocab_start, embedding.full_vocab,
                                           embedding.comm)
    return QuantEmbedding(qweight, dtype)


def local_vocab(cfg: ModelConfig, tp: TPShard) -> int:
    """Rows of the vocabulary the rank's embedding and LM head hold."""
    return tp.vocab.size if tp.parallel else cfg.vocab_size


class VocabParallelHead:
    """The LM head of a tensor-parallel model over the rank's LM head ``inner`` (its vocabulary rows):
    the :class:`~xllm.models.layers.LMHead` contract over the full vocabulary, on every rank."""

    def __init__(self, inner: LMHead, tp: TPShard) -> None:
        self.inner, self.comm = inner, tp.comm
        self.vocab_start, self.rows, self.vocab = tp.vocab.start, tp.vocab.size, tp.vocab_size
        self.chunk = vocab_chunk(tp.vocab_size, tp.size)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 logits ``[T, V]`` (the ranks' parts gathered in rank order)."""
        local = self.inner.logits(x)
        parts = self.comm.all_gather(F.pad(local, (0, self.chunk - self.rows)) if self.rows < self.chunk else local)
        if len(parts) == 1:  # a no-op communicator (slices loaded in one process): this rank's part only
            return local
        return torch.cat(parts, dim=-1)[..., :self.vocab]

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """``logits(x).argmax(-1)`` exactly: per rank its maximum and first index, then the first rank
        with the largest (lower ranks hold lower ids), without gathering the logits."""
        best, index = self.inner.logits(x).max(dim=-1)
        mine = torch.stack([best.double(), (index + self.vocab_start).double()], dim=-1)
        parts = torch.stack(self.comm.all_gather(mine))  # [ranks, T, 2]; ids < 2**53 are exact doubles
        rank = parts[..., 0].argmax(dim=0, keepdim=True)
        return parts[..., 1].gather(0, rank)[0].long()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x)


def parallel_head(head: LMHead, tp: TPShard) -> LMHead:
    """``head`` (the rank's rows) as the full-vocabulary LM head: itself in a one-process model."""
    return VocabParallelHead(head, tp) if tp.parallel else head
