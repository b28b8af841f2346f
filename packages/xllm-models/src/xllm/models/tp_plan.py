"""The arithmetic of a tensor-parallel split: which heads, intermediate channels and vocabulary rows
rank ``r`` of ``n`` holds (pure functions of the config; :mod:`xllm.models.tensor_parallel` slices the
checkpoint tensors with them).

- Attention heads follow their KV heads. With ``K`` KV heads, ``G = Q / K`` query heads per KV head:
  ``K >= n``: rank ``r`` holds ``K // n + (r < K % n)`` consecutive KV heads and their query heads
  (uneven when ``n`` does not divide ``K``); ``K < n``: each KV head is replicated on ``n / K``
  consecutive ranks, which split its ``G`` query heads evenly (needs ``n % K == 0`` and
  ``G % (n / K) == 0``).
- MLA (DeepSeek): the query heads split as evenly as possible; the latent KV is whole on every rank.
- MLP / expert intermediate channels: in blocks of 32 (a quantized block's width, so slicing an input
  dimension of a quantized weight never cuts a block) as evenly as possible, uneven allowed; a size that
  is not a multiple of 32, or has fewer blocks than ranks, splits channel by channel instead.
- Vocabulary: ``ceil(V / n)`` rows per rank, the last rank fewer (never none).
"""

from __future__ import annotations

from dataclasses import dataclass

from xllm.models.config import ModelConfigError

#: the unit an intermediate size is split in where it can be (quantized blocks are 32 wide)
CHANNEL_BLOCK = 32
_FLAG = "--tensor-parallel-size"


@dataclass(frozen=True)
class Span:
    """The half-open range ``[start, end)`` of a dimension one rank holds."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def scaled(self, unit: int) -> Span:
        """The same range in units ``unit`` times smaller (heads -> rows of ``unit``-wide heads)."""
        return Span(self.start * unit, self.end * unit)


def even_span(total: int, n: int, rank: int) -> Span:
    """Rank ``rank``'s share of ``total`` items split as evenly as possible (the first ``total % n``
    ranks one more)."""
    base, extra = divmod(total, n)
    start = rank * base + min(rank, extra)
    return Span(start, start + base + (1 if rank < extra else 0))


@dataclass(frozen=True)
class HeadSplit:
    """The query and KV heads one rank holds (head indices, not rows)."""

    q: Span
    kv: Span


def gqa_heads(num_heads: int, num_kv_heads: int, n: int, rank: int) -> HeadSplit:
    """Rank ``rank``'s query and KV heads under grouped-query attention (module docstring's rule);
    :class:`ModelConfigError` naming ``--tensor-parallel-size`` where the heads cannot be split."""
    q, k = num_heads, num_kv_heads
    if k < 1 or q % k:
        raise ModelConfigError(f"num_attention_heads={q} is not a multiple of num_key_value_heads={k}")
    group = q // k
    if k >= n:
        kv = even_span(k, n, rank)
        return HeadSplit(kv.scaled(group), kv)
    if n % k or group % (n // k):
        raise ModelConfigError(
            f"{_FLAG} {n} cannot split {k} KV heads of {group} query heads each: with fewer KV heads than "
            f"ranks, the size must be a multiple of the KV heads ({k}) whose quotient divides the {group} query "
            "heads per KV head")
    copies = n // k
    kv_head, part = divmod(rank, copies)
    per = group // copies
    start = kv_head * group + part * per
    return HeadSplit(Span(start, start + per), Span(kv_head, kv_head + 1))


def mla_heads(num_heads: int, n: int, rank: int) -> Span:
    """Rank ``rank``'s query heads of an MLA model (as even as possible)."""
    if num_heads < n:
        raise ModelConfigError(f"{_FLAG} {n} exceeds the model's {num_heads} attention heads")
    return even_span(num_heads, n, rank)


def channel_span(total: int, n: int, rank: int, what: str) -> Span:
    """Rank ``rank``'s channels of an MLP intermediate of ``total`` (blocks of 32 where it can)."""
    if total < n:
        raise ModelConfigError(f"{_FLAG} {n} exceeds {what}={total}")
    if total % CHANNEL_BLOCK == 0 and total // CHANNEL_BLOCK >= n:
        return even_span(total // CHANNEL_BLOCK, n, rank).scaled(CHANNEL_BLOCK)
    return even_span(total, n, rank)


def vocab_span(vocab: int, n: int, rank: int) -> Span:
    """Rank ``rank``'s vocabulary rows: ``ceil(vocab / n)`` each, the last rank the rest."""
    chunk = -(-vocab // n)
    if chunk * (n - 1) >= vocab:
        raise ModelConfigError(f"{_FLAG} {n} leaves a rank no rows of the {vocab}-token vocabulary")
    return Span(rank * chunk, min(vocab, (rank + 1) * chunk))


def vocab_chunk(vocab: int, n: int) -> int:
    """Rows of every rank's vocabulary part but the last's (the padded width of a gathered part)."""
    return -(-vocab // n)
