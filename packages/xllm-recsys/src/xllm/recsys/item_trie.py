"""Valid-item filtering: items are fixed-length token-id tuples (e.g. OneRec's
triples); only prefixes of real items may be generated."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class ItemTrie:
    """A trie over item token tuples of one fixed length.

    ``allowed(prefix)`` lists the tokens that extend ``prefix`` towards some
    valid item; :meth:`logit_mask` turns a batch of prefixes into an additive
    mask (0 where allowed, ``-inf`` elsewhere) to add to the logits before
    sampling or beam selection.
    """

    def __init__(self, items: Iterable[Sequence[int]]) -> None:
        self._children: dict[tuple[int, ...], set[int]] = {}
        self.item_len: int | None = None
        self.num_items = 0
        for item in items:
            item = tuple(int(t) for t in item)
            if self.item_len is None:
                if not item:
                    raise ValueError("items must be non-empty token tuples")
                self.item_len = len(item)
            elif len(item) != self.item_len:
                raise ValueError(f"all items must have {self.item_len} tokens, got {item}")
            for depth in range(len(item)):
                self._children.setdefault(item[:depth], set()).add(item[depth])
            self.num_items += 1
        if self.item_len is None:
            raise ValueError("an item trie needs at least one item")

    def allowed(self, prefix: Sequence[int]) -> list[int]:
        """Sorted tokens that may follow ``prefix`` (empty for a complete or invalid prefix)."""
        return sorted(self._children.get(tuple(prefix), ()))

    def is_item(self, tokens: Sequence[int]) -> bool:
        tokens = tuple(tokens)
        return len(tokens) == self.item_len and tokens[-1] in self._children.get(tokens[:-1], ())

    def logit_mask(self, prefixes: Sequence[Sequence[int]], vocab_size: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Additive mask ``[len(prefixes), vocab_size]``."""
        mask = torch.full((len(prefixes), vocab_size), float("-inf"), dtype=dtype)
        for row, prefix in enumerate(prefixes):
            ok = self.allowed(prefix)
            if ok:
                if ok[-1] >= vocab_size:
                    raise ValueError(f"item token {ok[-1]} is outside the vocabulary of {vocab_size}")
                mask[row, ok] = 0.0
        return mask
