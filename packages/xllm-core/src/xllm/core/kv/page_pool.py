"""Physical KV page bookkeeping shared by the xTensor and paged backends.

Every physical page is tracked as <PageID, Status, Owner> (xLLM §4.3) plus a
reference count and, once it holds a full computed block, the block's chained
prefix hash (the prefix cache). Status moves:

    FREE --take--> ALLOCATED --mapped/used--> MAPPED --last release--> REUSABLE
    REUSABLE --share (prefix hit) or reuse--> MAPPED
    REUSABLE --evicted (LRU) and taken--> ALLOCATED

A REUSABLE page keeps its contents (and, in xTensor, its mapping in the last
owner's slot) so it can be handed to the next sequence without map/unmap work
or serve a prefix-cache hit. Unhashed reusable pages are reclaimed before
hashed ones (they have no cache value); among each, least recently released
first. Pure bookkeeping: no tensors, no syscalls.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field


class PageStatus(enum.Enum):
    FREE = "free"
    ALLOCATED = "allocated"
    MAPPED = "mapped"
    REUSABLE = "reusable"


@dataclass
class Page:
    page_id: int
    status: PageStatus = PageStatus.FREE
    owner: str | None = None
    ref_count: int = 0
    block_hash: int | None = None
    # (slot, block index) pairs where this page is mapped and valid (xTensor only)
    mapped_at: set[tuple[int, int]] = field(default_factory=set)


class PagePool:
    """``num_pages`` pages, a hash -> page prefix cache and LRU reclaim order."""

    def __init__(self, num_pages: int, record_events: bool = False) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.pages = [Page(i) for i in range(num_pages)]
        self._free: deque[int] = deque(range(num_pages))
        self._plain: OrderedDict[int, None] = OrderedDict()   # reusable, no hash
        self._cached: OrderedDict[int, None] = OrderedDict()  # reusable, hashed
        self._by_hash: dict[int, int] = {}
        self.evictions = 0
        # (stored?, block hash) in order: what a cluster's global KV index must learn. Kept only while
        # someone drains them (an engine server publishing them); otherwise they would pile up.
        self.record_events = record_events
        self.events: list[tuple[bool, int]] = []
        # called with (page, block hash) when a cached block is evicted to reuse its page, before the page
        # changes hands (its contents are still the block's): the write-down to lower KV tiers
        self.on_evict: Callable[[int, int], None] | None = None

    # ---- capacity -----------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_available(self) -> int:
        """Pages a new allocation can get (free + reusable)."""
        return len(self._free) + len(self._plain) + len(self._cached)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - self.num_available

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    # ---- allocation -----------------------------------------------------------
    def take(self, owner: str, prefer: int | None = None) -> Page | None:
        """A page for ``owner`` (status ALLOCATED, one reference), or None if none is left.

        ``prefer`` names a reusable page to take if it is still available and
        unhashed (in-place reuse of a slot's old page). Otherwise: a free page,
        then the least recently released unhashed page, then the least recently
        released cached page (evicting its hash).
        """
        if prefer is not None and prefer in self._plain:
            del self._plain[prefer]
            return self._claim(prefer, owner)
        if self._free:
            return self._claim(self._free.popleft(), owner)
        for lru in (self._plain, self._cached):
            if lru:
                page_id, _ = lru.popitem(last=False)
                return self._claim(page_id, owner)
        return None

    def _claim(self, page_id: int, owner: str) -> Page:
        page = self.pages[page_id]
        if page.block_hash is not None:
            if self.on_evict is not None:
                self.on_evict(page_id, page.block_hash)
            self._by_hash.pop(page.block_hash, None)
            self._event(False, page.block_hash)
            page.block_hash = None
            self.evictions += 1
        page.status, page.owner, page.ref_count = PageStatus.ALLOCATED, owner, 1
        return page

    def share(self, page_id: int) -> Page:
        """Add a reference to a page holding a cached block (prefix hit)."""
        page = self.pages[page_id]
        if page.status == PageStatus.REUSABLE:
            self._cached.pop(page_id, None)
            self._plain.pop(page_id, None)
            page.status = PageStatus.MAPPED
        elif page.status == PageStatus.FREE:
            raise ValueError(f"page {page_id} is free and cannot be shared")
        page.ref_count += 1
        return page

    def mark_mapped(self, page_id: int) -> None:
        page = self.pages[page_id]
        if page.status == PageStatus.ALLOCATED:
            page.status = PageStatus.MAPPED

    def release(self, page_id: int) -> None:
        """Drop one reference; at zero the page becomes REUSABLE (kept for reuse/cache hits)."""
        page = self.pages[page_id]
        if page.ref_count <= 0:
            raise ValueError(f"page {page_id} released more often than taken")
        page.ref_count -= 1
        if page.ref_count == 0:
            page.status = PageStatus.REUSABLE
            (self._cached if page.block_hash is not None else self._plain)[page_id] = None

    def discard(self, page_id: int) -> None:
        """Return an unreferenced page to FREE (its contents and hash are dropped)."""
        page = self.pages[page_id]
        if page.ref_count:
            raise ValueError(f"page {page_id} is still referenced")
        self._plain.pop(page_id, None)
        self._cached.pop(page_id, None)
        if page.block_hash is not None:
            self._by_hash.pop(page.block_hash, None)
            self._event(False, page.block_hash)
            page.block_hash = None
        page.status, page.owner = PageStatus.FREE, None
        page.mapped_at.clear()
        self._free.append(page_id)

    # ---- prefix cache ---------------------------------------------------------------
    def set_hash(self, page_id: int, block_hash: int) -> bool:
        """Record that ``page_id`` holds the block with ``block_hash``. Returns False
        (and records nothing) when another page already caches that block."""
        page = self.pages[page_id]
        if page.block_hash is not None:
            return page.block_hash == block_hash
        if block_hash in self._by_hash:
            return False
        page.block_hash = block_hash
        self._by_hash[block_hash] = page_id
        self._event(True, block_hash)
        return True

    def _event(self, stored: bool, block_hash: int) -> None:
        if self.record_events:
            self.events.append((stored, block_hash))

    def drain_events(self) -> list[tuple[bool, int]]:
        """The (stored?, hash) events since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    def lookup(self, block_hash: int) -> int | None:
        return self._by_hash.get(block_hash)

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in PageStatus}
        for p in self.pages:
            out[p.status.value] += 1
        return out
