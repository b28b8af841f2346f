"""Chained prefix-block hashes.

A sequence's tokens are cut into full blocks of ``block_size``; block ``i``'s
hash covers its tokens *and* the hash of block ``i - 1``, so equal hashes mean
equal whole prefixes. Hashes are 64-bit BLAKE2b digests, stable across
processes and machines (Python's ``hash()`` is salted per process), so an
engine's cache events and a gateway's routing lookups agree.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0  # the "parent" of a sequence's first block


def hash_block(parent: int, tokens: Sequence[int], extra: bytes = b"") -> int:
    """Hash of one block given its parent's hash; ``extra`` separates namespaces
    (e.g. a LoRA adapter or multimodal input) that share token ids."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little", signed=False))
    h.update(array("i", tokens).tobytes())
    if extra:
        h.update(extra)
    return int.from_bytes(h.digest(), "little")


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH, extra: bytes = b"") -> list[int]:
    """Hashes of every *full* block of ``tokens`` (a trailing partial block has none)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start:start + block_size], extra)
        out.append(parent)
    return out
