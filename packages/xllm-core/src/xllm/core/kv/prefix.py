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

from xllm.core.kv.base import KVCacheBackend
from xllm.core.kv.layout import KVCacheLayout, PrefixStats
from xllm.core.kv.lower_tiers import LoadJob, LowerTiers
from xllm.core.kv.page_pool import PagePool, PageStatus
from xllm.kvstore.tier import TierStats


class PrefixCachingBackend(KVCacheBackend):
    prefix_cache = True

    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        self.pool = PagePool(layout.num_blocks)
        self._prefix_queries = 0   # prompt tokens looked up in the prefix cache
        self._prefix_hits = 0      # of those, tokens found cached
        self.reused_in_place = 0  # pages reused without any mapping work
        self.lower: LowerTiers | None = None  # tiers below this memory (attach_tiers)
        self._loading: dict[int, LoadJob] = {}  # block hash -> the load bringing it up
        self._load_pages = 0  # pages held by loads (taken for blocks, or pinning the T0 prefix before them)

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

    def _take_detached(self, owner: str) -> int | None:
        """A page for ``owner`` that no sequence addresses yet (a lower-tier load writes it)."""
        page = self.pool.take(owner)
        return None if page is None else page.page_id

    def _match_prefix(self, seq) -> list[int]:
        if not self.layout.enable_prefix_cache or seq.prompt_logprobs_pending is not None:
            return []  # (prompt logprobs: every prompt row's logits must be computed)
        # never the block holding the last known token: its logits must be computed
        max_blocks = (seq.num_tokens - 1) // self.layout.block_size
        hits: list[int] = []
        for h in self.block_hashes_of(seq, max_blocks):
            page = self.pool.lookup(h)
            if page is None:
                break
            hits.append(page)
        return hits

    # ---- KVAllocator (xllm.core.kv.contracts) ---------------------------------------------------------------
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
        hashes = self.block_hashes_of(seq, full)
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

    # ---- lower tiers (xllm.core.kv.lower_tiers) ----------------------------------------------------------
    @property
    def has_tiers(self) -> bool:
        return self.lower is not None

    @property
    def lower_tiers(self) -> LowerTiers | None:
        return self.lower

    def attach_tiers(self, tiers: LowerTiers) -> None:
        """Write blocks evicted from the prefix cache down to ``tiers`` and load prefixes from them."""
        self.lower = tiers
        self.pool.on_evict = tiers.on_evict

    def detach_tiers(self) -> None:
        self.lower = None
        self.pool.on_evict = None

    def drop_cached(self) -> int:
        """Forget every cached block nobody references, without writing it down (its KV is no longer
        wanted: new weights, or the memory goes while the engine sleeps); returns how many."""
        dropped = 0
        for page in self.pool.pages:
            if page.block_hash is not None and page.ref_count == 0:
                self.pool.discard(page.page_id)
                dropped += 1
        return dropped

    def begin_load(self, seq) -> LoadJob | None:
        """Look ``seq``'s prefix up in the lower tiers after this memory's prefix cache; when they hold
        the next blocks, take pages for them (loads hold at most 3/4 of the pool) and start loading.
        The job also pins the prefix already cached here. A job without pages waits for another
        request's load of the next block (look again once it is done). None: nothing to load."""
        if self.lower is None or not self.layout.enable_prefix_cache or seq.kv_pages or \
                seq.prompt_logprobs_pending is not None:
            return None
        max_blocks = (seq.num_tokens - 1) // self.layout.block_size
        hashes = self.block_hashes_of(seq, max_blocks)
        cached = 0
        while cached < max_blocks and self.pool.lookup(hashes[cached]) is not None:
            cached += 1
        if cached == max_blocks:
            return None
        other = self._loading.get(hashes[cached])
        if other is not None:
            return LoadJob([], [], other.future)
        room = min(self.layout.num_blocks * 3 // 4 - self._load_pages - cached, self.pool.num_available - 1)
        if room < 1:
            return None
        found = self.lower.match(hashes[cached:cached + room])
        if found < 1:
            return None
        pinned = [self.pool.lookup(h) for h in hashes[:cached]]
        for page in pinned:
            self.pool.share(page)
        pages = []
        for _ in range(found):
            page = self._take_detached(f"load:{seq.request_id}")
            if page is None:
                break
            pages.append(page)
        if not pages:
            for page in pinned:
                self.pool.release(page)
            return None
        job = self.lower.load(hashes[cached:cached + len(pages)], pages)
        job.pinned = pinned
        for h in job.hashes:
            self._loading[h] = job
        self._load_pages += len(pages) + len(pinned)
        return job

    def end_load(self, job: LoadJob) -> int:
        """A done load's intact blocks enter the prefix cache (pages still held until
        :meth:`release_load`); returns how many."""
        if not job.pages:
            return 0
        loaded = self.lower.finished(job)
        for j, (h, page) in enumerate(zip(job.hashes, job.pages, strict=True)):
            if self._loading.get(h) is job:
                del self._loading[h]
            if j < loaded and self.pool.lookup(h) is None:
                self.pool.set_hash(page, h)
        return loaded

    def release_load(self, job: LoadJob) -> None:
        """Drop the job's page references (after the request's admission shared what it needs)."""
        for page in job.pages + job.pinned:
            self.pool.release(page)
        self._load_pages -= len(job.pages) + len(job.pinned)
        job.pages, job.pinned = [], []

    def evict_cached(self) -> int:
        """Drop every cached block nobody references from this memory, writing each down to the lower
        tiers first (as a capacity eviction would); returns how many. For benchmarks and tests that
        need a prefix in the lower tiers only, or an operator emptying T0 before a restart."""
        dropped = 0
        for page in self.pool.pages:
            if page.block_hash is not None and page.ref_count == 0:
                if self.lower is not None:
                    self.lower.on_evict(page.page_id, page.block_hash)
                self.pool.discard(page.page_id)
                dropped += 1
        return dropped

    def tier_stats(self) -> dict[str, TierStats]:
        lower = self.lower  # (any thread: a metrics scrape may race close)
        return {} if lower is None else lower.stats()

    def drain_tier_events(self) -> list[tuple[str, bool, int]]:
        lower = self.lower
        return [] if lower is None else lower.drain_events()

    def close(self) -> None:
        if self.lower is not None:
            self.lower.close()
            self.lower = None

    def enable_events(self) -> None:
        self.pool.record_events = True

    def drain_events(self) -> list[tuple[bool, int]]:
        return self.pool.drain_events()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_available
