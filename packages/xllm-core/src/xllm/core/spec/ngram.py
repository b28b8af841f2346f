"""Prompt lookup (``--speculative ngram``): the tokens that followed the most recent earlier
occurrence of the sequence's longest suffix (of ``min_n..max_n`` tokens) in its prompt + output.

Each sequence keeps an index ``n-gram -> the last position it ended at`` per ``n``, extended by
the tokens that arrived since the last call, so a step costs O(new tokens · n range + k) however
long the prompt (vLLM measured its scan-the-prompt proposer's CPU time mattering on long prompts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xllm.core.sequence import Sequence
from xllm.core.spec.base import ProposerContext

MIN_N = 1
MAX_N = 4


@dataclass
class NgramIndex:
    """n-gram → position of its last token, for n-grams ending before position ``indexed``."""

    min_n: int = MIN_N
    max_n: int = MAX_N
    indexed: int = 0
    maps: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.maps = {n: {} for n in range(self.min_n, self.max_n + 1)}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Index the tokens before the last one, then look the suffix up (longest n first)."""
        length = seq.num_tokens
        if length < 2 or k < 1:
            return []
        end = length - 1  # n-grams ending at positions < end: never the suffix itself
        if end > self.indexed:
            lo = max(0, self.indexed - self.max_n + 1)
            tokens = seq.token_slice(lo, end)
            for e in range(self.indexed, end):
                for n, table in self.maps.items():
                    if e - n + 1 >= 0:
                        table[tuple(tokens[e - n + 1 - lo:e + 1 - lo])] = e
            self.indexed = end
        tail = seq.token_slice(max(0, length - self.max_n), length)
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            e = self.maps[n].get(tuple(tail[len(tail) - n:]))
            if e is not None:
                return seq.token_slice(e + 1, min(e + 1 + k, length))
        return []


class NgramProposer:
    """:class:`~xllm.core.spec.base.Proposer` by prompt lookup (one :class:`NgramIndex` per sequence)."""

    def __init__(self, ctx: ProposerContext | None = None, min_n: int = MIN_N, max_n: int = MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[Sequence, NgramIndex] = {}

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        out = []
        for seq, k in requests:
            index = self._index.get(seq)
            if index is None:
                index = self._index[seq] = NgramIndex(self.min_n, self.max_n)
            out.append(index.propose(seq, k))
        return out

    def release(self, seq: Sequence) -> None:
        self._index.pop(seq, None)

    def close(self) -> None:
        self._index.clear()
