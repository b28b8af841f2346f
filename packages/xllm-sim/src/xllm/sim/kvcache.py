"""One simulated instance's KV memory: a fixed number of blocks and a prefix cache by chained block
hashes, with the engine's accounting (``xllm.core.kv.prefix`` over ``PagePool``) and no tensors.

A sequence holds one block per ``block_size`` tokens (``seq.blocks``: the block's hash once it is a
full computed block registered in the cache, else ``None``). Full computed blocks are registered
under their hash (a block whose hash another block already caches stays unregistered, as
``PagePool.set_hash`` refuses it); a later sequence whose prompt starts with the same blocks
shares them (reference counted) and skips their prefill, never the block holding its last known
token. A released registered block stays cached (reusable) until a new allocation evicts it:
unregistered free blocks are taken first, then the least recently released cached block.

Block hashes are synthetic integers (no token contents are simulated): block ``j`` of a request
is its prefix group's ``j``-th block while the block lies inside the shared prefix, else the
request's own. Equal hashes mean equal whole prefixes, as with the chained hashes of
``xllm.kvstore``. Only shared-prefix blocks (negative hashes) are reported to ``listener``: no
other request can ever match a request's own blocks.
"""

from __future__ import annotations

from collections.abc import Callable

HASH_BITS = 24  # block index bits of a synthetic hash: prompts up to 2**24 blocks


def block_hash(rid: int, group: int, shared_blocks: int, j: int) -> int:
    """The synthetic hash of block ``j`` of request ``rid`` whose first ``shared_blocks`` blocks are
    the prefix of ``group``."""
    if j < shared_blocks:
        return -((group << HASH_BITS) | j) - 1
    return (rid << HASH_BITS) | j


class KVSeq:
    """What the KV accounting keeps on a sequence (the simulator's sequences subclass it)."""

    __slots__ = ("blocks", "group", "nhashed", "num_computed_tokens", "num_tokens", "rid", "shared_blocks")

    def __init__(self, rid: int, group: int, shared_blocks: int, num_tokens: int) -> None:
        self.rid, self.group, self.shared_blocks = rid, group, shared_blocks
        self.num_tokens = num_tokens
        self.num_computed_tokens = 0
        self.blocks: list[int | None] = []
        self.nhashed = 0

    def hash_of(self, j: int) -> int:
        return block_hash(self.rid, self.group, self.shared_blocks, j)


class SimKV:
    """``num_blocks`` blocks of ``block_size`` tokens with a prefix cache; ``listener(stored, hash)``
    hears shared-prefix blocks entering (True) and leaving (False) the cache."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True,
                 listener: Callable[[bool, int], None] | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_cache = prefix_cache
        self.listener = listener
        self.refs: dict[int, int] = {}         # registered hash -> references (0: cached, reusable)
        self.lru: dict[int, None] = {}         # registered hashes with no reference, least recent first
        self.used = 0                          # blocks referenced by sequences
        self.evictions = 0
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def available(self) -> int:
        """Blocks a new allocation can get (free + cached without references)."""
        return self.num_blocks - self.used

    @property
    def usage(self) -> float:
        return self.used / self.num_blocks

    def _take(self) -> None:
        """One block for a sequence: a free one, else evict the least recently released cached one."""
        if self.num_blocks - self.used - len(self.lru) <= 0:
            h = next(iter(self.lru))
            del self.lru[h]
            del self.refs[h]
            self.evictions += 1
            if h < 0 and self.listener is not None:
                self.listener(False, h)
        self.used += 1

    def match(self, seq: KVSeq) -> int:
        """Blocks of ``seq``'s prefix cached here (never the one holding its last known token)."""
        if not self.prefix_cache:
            return 0
        refs = self.refs
        hits = 0
        for j in range((seq.num_tokens - 1) // self.block_size):
            if seq.hash_of(j) not in refs:
                break
            hits += 1
        return hits

    def admit(self, seq: KVSeq, max_new_tokens: int, max_model_len: int = 0) -> int:
        """Give ``seq`` (holding nothing) its cached prefix and room for up to ``max_new_tokens`` of the
        rest; its ``num_computed_tokens`` becomes the cached length. Returns the tokens to compute now,
        0 (nothing changed) when memory is short."""
        bs = self.block_size
        hits = self.match(seq)
        cached = hits * bs
        n = min(seq.num_tokens - cached, max_new_tokens)
        if n < 1 or (max_model_len and cached + n > max_model_len):
            return 0
        refs, lru = self.refs, self.lru
        hashes = [seq.hash_of(j) for j in range(hits)]
        reviving = sum(1 for h in hashes if refs[h] == 0)
        if (cached + n + bs - 1) // bs - hits > self.available - reviving:
            return 0
        for h in hashes:
            if refs[h] == 0:
                del lru[h]
                self.used += 1
            refs[h] += 1
        seq.blocks = list(hashes)
        seq.nhashed = hits
        seq.num_computed_tokens = cached
        self.allocate(seq, n)
        return n

    def allocate(self, seq: KVSeq, num_new_tokens: int) -> bool:
        """Room for ``num_new_tokens`` more tokens of ``seq``; False (nothing changed) if short."""
        missing = (seq.num_computed_tokens + num_new_tokens + self.block_size - 1) // self.block_size - len(seq.blocks)
        if missing <= 0:
            return True
        if missing > self.num_blocks - self.used:
            return False
        blocks = seq.blocks
        for _ in range(missing):
            self._take()
            blocks.append(None)
        return True

    def on_computed(self, seq: KVSeq) -> None:
        """Register ``seq``'s full computed blocks in the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.nhashed or not self.prefix_cache:
            return
        full = min(full, len(seq.blocks))
        refs, blocks = self.refs, seq.blocks
        for j in range(seq.nhashed, full):
            h = seq.hash_of(j)
            if h not in refs:  # else another block already caches it: this one stays unregistered
                refs[h] = 1
                blocks[j] = h
                if h < 0 and self.listener is not None:
                    self.listener(True, h)
        seq.nhashed = max(full, seq.nhashed)

    def free(self, seq: KVSeq) -> None:
        """Release ``seq``'s blocks (registered ones stay cached until evicted)."""
        refs, lru = self.refs, self.lru
        for h in seq.blocks:
            if h is None:
                self.used -= 1
                continue
            r = refs[h] - 1
            refs[h] = r
            if r == 0:
                lru[h] = None
                self.used -= 1
        seq.blocks = []
        seq.nhashed = 0
