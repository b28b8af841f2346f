"""Page-based KV backends with a prefix cache: the logic xTensor and the paged
fallback share.

A sequence holds ``seq.kv_pages`` (one page ID per block of ``block_size``
tokens). Full computed blocks are hashed with the chained hash of
:mod:`xllm.kvstore.hashing` and registered in the :class:`PagePool`, so a later
sequence with the same prefix shares those pages (reference counted) and skips
their prefill. Subclasses decide how a page becomes addressable (mapping into a
virtual slot, or a block-table entry).
"""

from __future__ import annotations

from abc import abstractmethod

from xllm.core.kv.base import KVCacheBackend, KVCacheLayout, PrefixStats
from xllm.core.kv.page_pool import PagePool, PageStatus
from xllm.kvstore import ROOT_HASH, hash_block


class PrefixCachingBackend(KVCacheBackend):
    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        self.pool = PagePool(layout.num_blocks)
        self._prefix_queries = 0   # prompt tokens looked up in the prefix cache
        self._prefix_hits = 0      # of those, tokens found cached
        self.reused_in_place = 0  # pages reused without any mapping work

    # ---- subclass hooks ------------------------------------------------------------
    @abstractmethod
    def _attach(self, seq, hit_pages: list[int]) -> bool:
        """Give ``seq`` an address (slot) and make ``hit_pages`` its first blocks."""

    @abstractmethod
    def _detach(self, seq) -> None:
        """Undo :meth:`_attach` (pages are released by the caller); nothing if ``seq`` holds no address."""

    @abstractmethod
    def _new_page(self, seq, block: int, sync: bool = True) -> int | None:
        """Take a page for ``seq``'s block ``block`` and make it addressable."""

    def _before_compute(self, seq, first_block: int, last_block: int) -> None:
        """Called before blocks ``first..last`` are written (wait for async mapping)."""

    # ---- hashing -------------------------------------------------------------------
    def _extend_hashes(self, seq, num_blocks: int) -> list[int]:
        bs = self.layout.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            j = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, seq.token_slice(j * bs, (j + 1) * bs)))
        return hashes

    def _match_prefix(self, seq) -> list[int]:
        if not self.layout.enable_prefix_cache or seq.prompt_logprobs_pending is not None:
            return []  # (prompt logprobs: every prompt row's logits must be computed)
        # never the block holding the last known token: its logits must be computed
        max_blocks = (seq.num_tokens - 1) // self.layout.block_size
        hits: list[int] = []
        for h in self._extend_hashes(seq, max_blocks):
            page = self.pool.lookup(h)
            if page is None:
                break
            hits.append(page)
        return hits

    # ---- KVAllocator ---------------------------------------------------------------
    def admit(self, seq, max_new_tokens: int) -> int:
        if seq.kv_pages:
            raise ValueError(f"{seq.request_id} already holds KV pages")
        bs = self.layout.block_size
        hits = self._match_prefix(seq)
        cached = len(hits) * bs
        n = min(seq.num_tokens - cached, max_new_tokens)
        if n < 1 or cached + n > self.layout.max_model_len:
            return 0
        reviving = sum(1 for p in hits if self.pool.pages[p].status == PageStatus.REUSABLE)
        if self.layout.blocks_for(cached + n) - len(hits) > self.pool.num_available - reviving:
            return 0
        for p in hits:
            self.pool.share(p)
        if not self._attach(seq, hits):
            for p in hits:
                self.pool.release(p)
            return 0
        seq.kv_pages = list(hits)
        seq.num_computed_tokens = cached
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = min(cached, seq.num_prompt_tokens)
            if self.layout.enable_prefix_cache:
                self._prefix_queries += seq.num_prompt_tokens
                self._prefix_hits += seq.num_cached_prompt_tokens
        if not self.allocate(seq, n):
            self.free(seq)
            return 0
        return n

    def allocate(self, seq, num_new_tokens: int) -> bool:
        start = seq.num_computed_tokens
        target = start + num_new_tokens
        if target > self.layout.max_model_len:
            return False
        need = self.layout.blocks_for(target)
        missing = need - len(seq.kv_pages)
        if missing > self.pool.num_available:
            return False
        for block in range(len(seq.kv_pages), need):
            page = self._new_page(seq, block)
            if page is None:  # cannot happen after the capacity check; keep state consistent anyway
                return False
            seq.kv_pages.append(page)
        self._before_compute(seq, start // self.layout.block_size, need - 1)
        return True

    def free(self, seq) -> None:
        self._detach(seq)
        for page in seq.kv_pages:
            self.pool.release(page)
        seq.kv_pages = []

    def on_computed(self, seq) -> None:
        """Register the hashes of ``seq``'s blocks that are now full and computed."""
        if not self.layout.enable_prefix_cache:
            return
        full = min(seq.num_computed_tokens // self.layout.block_size, len(seq.kv_pages))
        if full <= seq.num_hashed_blocks:
            return
        hashes = self._extend_hashes(seq, full)
        for j in range(seq.num_hashed_blocks, full):
            self.pool.set_hash(seq.kv_pages[j], hashes[j])
        seq.num_hashed_blocks = full

    def prefetch(self, seqs) -> None:
        """Take and map (asynchronously) the page each decoding sequence needs next step."""
        bs = self.layout.block_size
        for seq in seqs:
            next_pos = seq.num_tokens  # the token sampled this step is written next step
            block = next_pos // bs
            if next_pos % bs or block != len(seq.kv_pages) or next_pos >= self.layout.max_model_len:
                continue
            if self.pool.num_available <= 0:
                return
            page = self._new_page(seq, block, sync=False)
            if page is not None:
                seq.kv_pages.append(page)

    @property
    def prefix_stats(self) -> PrefixStats:
        return PrefixStats(self._prefix_queries, self._prefix_hits)

    def enable_events(self) -> None:
        self.pool.record_events = True

    def drain_events(self) -> list[tuple[bool, int]]:
        return self.pool.drain_events()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_available
