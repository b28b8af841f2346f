"""The item catalogue: every valid item as a fixed-length token tuple, as a compact CSR trie.

Generative recommendation decodes an item's semantic-ID tuple (e.g. 3 tokens) and must produce only
items that exist (xLLM §4.5.2, valid item filtering). :class:`ItemCatalog` holds the items sorted
lexicographically and, per depth, the trie level as two flat arrays (no Python object per node):

- ``level_tokens[d]`` (int64 ``[n_{d+1}]``): the last token of every distinct prefix of ``d + 1``
  tokens, in sorted prefix order; a node at depth ``d + 1`` is its index there.
- ``level_offsets[d]`` (int64 ``[n_d + 1]``): node ``i`` at depth ``d`` has as children the nodes
  ``[level_offsets[d][i], level_offsets[d][i + 1])`` at depth ``d + 1``, sorted by token.

Depth 0 is the root (one node). A depth-``L`` node is an item: its index is the item's row in the
sorted array, and ``item_ids`` maps it back to its line in the catalogue file.

Allowed-token lookups are vectorized over a batch of nodes (:meth:`children`): one gather, no loop
over beams or tokens. 10^6 three-token items take ~30 MB and load in about a second from ``.npy``.

File formats (:meth:`load`): ``.npy`` (an integer array ``[N, L]``, read with ``np.load``) or JSON
lines (one JSON array of token ids per line; blank lines skipped).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class Children:
    """The children of a batch of ``B`` trie nodes, padded to the widest (``F`` columns).

    ``tokens[b, j]`` is the token of child ``j`` of node ``b`` (0 where ``valid`` is false);
    ``first[b]`` is the node id of child 0 at the next depth, so child ``j`` is ``first[b] + j``."""

    tokens: torch.Tensor  # int64 [B, F]
    valid: torch.Tensor   # bool [B, F]
    first: torch.Tensor   # int64 [B]


class ItemCatalog:
    """Valid items (token tuples of one length ``item_len``) as a CSR trie; immutable after construction."""

    def __init__(self, items: np.ndarray | torch.Tensor | list) -> None:
        arr = np.asarray(items.numpy() if isinstance(items, torch.Tensor) else items)
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise ValueError(f"a catalogue is a non-empty [items, tokens] integer array, got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"catalogue token ids must be integers, got {arr.dtype}")
        if arr.min() < 0:
            raise ValueError("catalogue token ids must be >= 0")
        if arr.max() > np.iinfo(np.int32).max:
            raise ValueError("catalogue token ids must fit in int32")
        arr = np.ascontiguousarray(arr, dtype=np.int32)
        n, length = arr.shape
        order = np.lexsort(arr.T[::-1])  # rows sorted lexicographically (first column most significant)
        arr = arr[order]
        keep = np.ones(n, dtype=bool)
        if n > 1:
            keep[1:] = (arr[1:] != arr[:-1]).any(axis=1)  # duplicates collapse into the first line's item
        arr, order = arr[keep], order[keep]
        self.item_len = length
        self.items = torch.from_numpy(arr)                      # int32 [N, L], sorted, unique
        self.item_ids = torch.from_numpy(order.astype(np.int64))  # row in the file of each sorted item
        self.num_items = len(arr)
        tokens: list[torch.Tensor] = []
        offsets: list[torch.Tensor] = []
        changed = np.zeros(len(arr), dtype=bool)
        changed[0] = True
        parent_of_row = np.zeros(len(arr), dtype=np.int64)  # node id at depth d of each row's prefix
        num_parents = 1
        for d in range(length):
            if len(arr) > 1:
                changed[1:] |= arr[1:, d] != arr[:-1, d]
            starts = np.flatnonzero(changed)                 # first row of each distinct prefix of d + 1 tokens
            tokens.append(torch.from_numpy(arr[starts, d].astype(np.int64)))
            counts = np.bincount(parent_of_row[starts], minlength=num_parents)
            off = np.zeros(num_parents + 1, dtype=np.int64)
            np.cumsum(counts, out=off[1:])
            offsets.append(torch.from_numpy(off))
            parent_of_row = np.cumsum(changed) - 1
            num_parents = len(starts)
        self.level_tokens = tokens
        self.level_offsets = offsets
        self.max_token = int(arr.max())

    # ---- loading ----------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> ItemCatalog:
        """A catalogue file: ``.npy`` (integer ``[N, L]``) or JSON lines of token-id arrays.
        Raises ``ValueError`` naming the file and the problem."""
        path = Path(path)
        try:
            if path.suffix == ".npy":
                arr = np.load(path, allow_pickle=False)
            else:
                text = path.read_text()
                lines = [ln for ln in text.splitlines() if ln.strip()]
                arr = np.asarray(json.loads("[" + ",".join(lines) + "]"))  # one parse for all lines
            return cls(arr)
        except (OSError, ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"item catalogue {path}: {exc}") from exc

    def save_npy(self, path: str | Path) -> None:
        """The distinct items in their file order as ``.npy`` int32 ``[N, L]`` (a duplicate line dropped:
        the later lines' numbers shift)."""
        np.save(Path(path), self.items[torch.argsort(self.item_ids)].numpy())

    # ---- lookups ----------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Memory held by the trie and the items."""
        parts = [self.items, self.item_ids, *self.level_tokens, *self.level_offsets]
        return sum(t.numel() * t.element_size() for t in parts)

    def root(self, batch: int = 1) -> torch.Tensor:
        """The root node (depth 0), ``batch`` times."""
        return torch.zeros(batch, dtype=torch.int64)

    def children(self, depth: int, nodes: torch.Tensor) -> Children:
        """The allowed next tokens of the depth-``depth`` nodes ``nodes`` (int64 ``[B]``), padded."""
        if not 0 <= depth < self.item_len:
            raise ValueError(f"depth must be in [0, {self.item_len}), got {depth}")
        off = self.level_offsets[depth]
        first = off[nodes]
        count = off[nodes + 1] - first
        width = max(int(count.max()), 1) if len(nodes) else 1
        col = torch.arange(width, dtype=torch.int64)
        valid = col[None, :] < count[:, None]
        idx = torch.where(valid, first[:, None] + col[None, :], first[:, None])
        level = self.level_tokens[depth]
        tokens = level[idx.clamp_(max=max(len(level) - 1, 0))].masked_fill_(~valid, 0)
        return Children(tokens, valid, first)

    def allowed(self, prefix: list[int] | tuple[int, ...]) -> list[int]:
        """Sorted tokens that may follow ``prefix`` (empty for a complete or invalid prefix)."""
        node = self.node_of(prefix)
        if node is None or len(prefix) >= self.item_len:
            return []
        ch = self.children(len(prefix), torch.tensor([node]))
        return ch.tokens[0][ch.valid[0]].tolist()

    def node_of(self, prefix: list[int] | tuple[int, ...]) -> int | None:
        """The node id of ``prefix`` at depth ``len(prefix)``, or None when no item starts with it."""
        node = 0
        for d, token in enumerate(prefix):
            if d >= self.item_len:
                return None
            lo, hi = int(self.level_offsets[d][node]), int(self.level_offsets[d][node + 1])
            toks = self.level_tokens[d][lo:hi]
            j = int(torch.searchsorted(toks, torch.tensor(int(token))))
            if j >= len(toks) or int(toks[j]) != int(token):
                return None
            node = lo + j
        return node

    def is_item(self, tokens: list[int] | tuple[int, ...]) -> bool:
        return len(tokens) == self.item_len and self.node_of(tokens) is not None

    def item_id(self, leaf: int) -> int:
        """The file row of the item at depth-``item_len`` node ``leaf``."""
        return int(self.item_ids[leaf])

    def logit_mask(self, prefixes: list[list[int]], vocab_size: int, dtype: torch.dtype = torch.float32
                   ) -> torch.Tensor:
        """Additive mask ``[len(prefixes), vocab_size]`` (0 where allowed, ``-inf`` elsewhere), all
        prefixes of one length (xLLM's form; the engine gathers the allowed columns instead)."""
        mask = torch.full((len(prefixes), vocab_size), float("-inf"), dtype=dtype)
        if not prefixes:
            return mask
        depth = len(prefixes[0])
        if any(len(p) != depth for p in prefixes):
            raise ValueError("all prefixes of one mask must have the same length")
        if self.max_token >= vocab_size:
            raise ValueError(f"item token {self.max_token} is outside the vocabulary of {vocab_size}")
        nodes = [self.node_of(p) for p in prefixes]
        live = [i for i, n in enumerate(nodes) if n is not None]
        if live and depth < self.item_len:
            ch = self.children(depth, torch.tensor([nodes[i] for i in live]))
            rows = torch.tensor(live)[:, None].expand_as(ch.tokens)
            mask[rows[ch.valid], ch.tokens[ch.valid]] = 0.0
        return mask
