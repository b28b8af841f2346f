"""The engine's side of the KV tiers below its own memory (T1 host, T2 disk, ...; see
:mod:`xllm.kvstore.tiered`): write-down of evicted blocks, lookups, and loads into KV pages.

Lifecycle of a block (chained hash ``h``, the same in every tier and process):

1. computed in T0 and registered in the prefix cache (``PrefixCachingBackend.on_computed``);
2. evicted from T0 when its page is taken for other work (``PagePool`` calls :meth:`LowerTiers.on_evict`
   on the engine thread): its bytes are copied out of the page, the one cost on the step's path, and
   queued for the writer thread, which writes it to every lower tier lacking it;
3. found again for a new request: :meth:`LowerTiers.match` after the T0 prefix match, then
   :meth:`LowerTiers.load` reads the blocks on the loader thread straight into pages taken for them
   (each block checked against its hash, namespace and checksum first) while the step loop serves
   other requests; a block that fails stops the load there (the rest is recomputed);
4. the loaded blocks enter T0's prefix cache, and the request's admission finds them there.

Prefill/decode hand-offs through the cluster store (``xllm.engine.handoff.mooncake``) use the same
tiers, blocking, from the engine server's threads: :meth:`LowerTiers.publish` puts a request's blocks
into the store tier under their hashes (prefill side), :meth:`LowerTiers.fetch` reads them into the
reserved pages (decode side) exactly as a prefix load does; the blocks then stay there as T3 blocks.

Pages are reached through a :class:`~xllm.core.kv.page_store.PageAccess`: one process's
:class:`~xllm.core.kv.page_store.PageStore` (loads land in the pages' bytes in place), or a tensor-parallel
instance's :class:`~xllm.core.executor.kv_pages.ShardedPageStore` (every rank's KV heads in the canonical
layout: a stored block holds every head, whatever the writer's tensor-parallel size; loads are staged in
memory, then scattered to the ranks as whole blocks, ``write_blocks``). With the sharded store every page
read and write waits for the runner's lock (a step in flight ends first: an eviction's copy may delay the
next step's scheduling by the rest of the forward in flight) and runs collectives with the worker ranks; the
engine thread's write-down copies (:meth:`LowerTiers.on_evict`) and the loader thread's writes never run
inside a step, so they cannot deadlock it. Torch-free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from xllm.core.kv.page_store import PageAccess, PageStore
from xllm.engine_api.errors import ConfigError
from xllm.kvstore.file_tier import FileTier
from xllm.kvstore.mooncake_tier import MooncakeTier, parse_url
from xllm.kvstore.tier import DISK, HOST, STORE, KVTier, TierDownError, TierStats, namespace
from xllm.kvstore.tiered import TieredStore

log = logging.getLogger(__name__)


@dataclass
class LoadJob:
    """Blocks of one request coming up from lower tiers into ``pages`` (taken for them, one reference
    each, held by the job). ``future`` resolves to how many leading blocks arrived intact. A job with
    no pages only waits for another request's load of the same blocks (``waits_for``)."""

    hashes: list[int]
    pages: list[int]
    future: Future
    pinned: list[int] = field(default_factory=list)  # pages of the prefix already in T0, referenced meanwhile
    started: float = field(default_factory=time.perf_counter)
    loaded: int = 0

    @property
    def done(self) -> bool:
        return self.future.done()


@dataclass
class TierCounters:
    """Engine-side counts of lower-tier loads: requests that waited for a load, blocks asked and
    loaded, and the loads' wall time (from the request's point of view)."""

    loads: int = 0
    blocks_requested: int = 0
    blocks_loaded: int = 0
    written_down: int = 0
    skipped_writes: int = 0
    load_seconds: float = 0.0


class LowerTiers:
    """One backend's link to a :class:`TieredStore` (see the module docstring). Engine thread,
    except the loads and writes it hands to its threads."""

    def __init__(self, store: TieredStore, pages: PageAccess) -> None:
        self.store = store
        self.pages = pages
        self.counters = TierCounters()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xllm-kv-loader")

    def page_views(self, page: int) -> list[memoryview]:
        """The writable pieces of page ``page`` in block order (one per (layer, K|V) range); a
        :class:`PageStore`'s only (a sharded store's pages are not in this process)."""
        if not isinstance(self.pages, PageStore):
            raise TypeError(f"{type(self.pages).__name__} pages have no views in this process")
        return [buf[page * pb:(page + 1) * pb] for buf, pb in zip(self.pages.buffers, self.pages.page_bytes,
                                                                  strict=True)]

    def _read_into(self, hashes: list[int], pages: Sequence[int]) -> int:
        """Read blocks ``hashes`` from the tiers into ``pages``: in place (a :class:`PageStore`), else staged and
        written as whole blocks (only the leading intact ones); how many leading blocks arrived intact."""
        if isinstance(self.pages, PageStore):
            return self.store.load_many(hashes, [self.page_views(p) for p in pages])
        staged = [bytearray(self.pages.block_bytes) for _ in pages]
        n = self.store.load_many(hashes, [_pieces(memoryview(b), self.pages.page_bytes) for b in staged])
        if n:
            self.pages.write_blocks(list(pages[:n]), staged[:n])  # type: ignore[attr-defined]  (ShardedPageStore)
        return n

    def _read_blocks(self, pages: Sequence[int]) -> list[bytes]:
        """The blocks in ``pages`` (a sharded store's in as few exchanges as fit)."""
        read_blocks = getattr(self.pages, "read_blocks", None)
        if read_blocks is not None:
            return read_blocks(list(pages))
        return [self.pages.read_block(p) for p in pages]

    # ---- write-down ----------------------------------------------------------------------------
    def on_evict(self, page: int, block_hash: int) -> None:
        """T0 drops the cached block in ``page`` (about to be reused): queue its bytes for the lower
        tiers, unless they all have it already."""
        try:
            if self.store.stored_everywhere(block_hash):
                self.counters.skipped_writes += 1
            elif self.store.write_down(block_hash, self.pages.read_block(page)):
                self.counters.written_down += 1
        except Exception:  # never let a lower tier break T0's allocation
            log.exception("KV tiers: writing block %016x down failed", block_hash)

    # ---- loads ------------------------------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` some lower tier (or the write queue) holds."""
        return len(self.store.match(hashes))

    def load(self, hashes: list[int], pages: list[int]) -> LoadJob:
        """Start reading blocks ``hashes`` into ``pages`` (same length) on the loader thread."""
        job = LoadJob(hashes, pages, self._loader.submit(self._load, hashes, pages))
        self.counters.loads += 1
        self.counters.blocks_requested += len(hashes)
        return job

    def _load(self, hashes: list[int], pages: list[int]) -> int:
        try:
            return self._read_into(hashes, pages)
        except Exception:  # a bad queue entry or a tier's bug: recompute
            log.exception("KV tiers: loading %d blocks failed", len(hashes))
            return 0

    # ---- prefill/decode hand-offs through the cluster store (blocking: call from a thread) ---------------
    @property
    def has_store(self) -> bool:
        """Whether the cluster store tier (T3) is attached and not in an outage now."""
        return any(t.name == STORE and self.store.is_up(t) for t in self.store.tiers)

    def publish(self, hashes: Sequence[int], pages: Sequence[int]) -> int:
        """Prefill side: put the blocks in ``pages`` into the store tier under ``hashes`` (those it lacks, one
        batch); returns how many leading blocks it holds afterwards (0: no store, or it is down)."""
        if not hashes or not self.has_store:
            return 0
        blocks = self._read_blocks(pages)
        there = self.store.publish(STORE, list(zip(hashes, blocks, strict=True)))
        return next((j for j, ok in enumerate(there) if not ok), len(there))

    def fetch(self, hashes: Sequence[int], pages: Sequence[int]) -> int:
        """Decode side: read blocks ``hashes`` into ``pages`` from the tiers (each checked against its hash,
        namespace and checksum); returns how many leading blocks arrived intact."""
        return self._read_into(list(hashes), pages)

    def finished(self, job: LoadJob) -> int:
        """A done job's count of intact leading blocks (recorded in the counters)."""
        try:
            job.loaded = job.future.result()
        except Exception:
            log.exception("KV tiers: a load failed")
            job.loaded = 0
        self.counters.blocks_loaded += job.loaded
        self.counters.load_seconds += time.perf_counter() - job.started
        return job.loaded

    # ---- reports and shutdown ------------------------------------------------------------------------
    def stats(self) -> dict[str, TierStats]:
        return self.store.stats()

    def drain_events(self) -> list[tuple[str, bool, int]]:
        """``(tier, stored?, block hash)`` since the last call (:meth:`TieredStore.drain_events`)."""
        return self.store.drain_events()

    def scopes(self) -> dict[str, str]:
        """Each tier's storage (:meth:`TieredStore.scopes`)."""
        return self.store.scopes()

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self.store.close()


def _pieces(block: memoryview, sizes: Sequence[int]) -> list[memoryview]:
    """``block`` cut into its ranges' pages (``sizes``), in block order."""
    out, at = [], 0
    for n in sizes:
        out.append(block[at:at + n])
        at += n
    return out


def build_store(layout: str, model_identity: str | None, host_gib: float | None, host_dir: str,
                disk_dir: str | None, disk_gib: float, store: str | None = None, store_metadata: str | None = None,
                store_segment_gib: float = 1.0) -> TieredStore | None:
    """The lower tiers the settings name (``EngineConfig.kv_*``), fastest first, within the namespace
    of ``model_identity`` and the KV ``layout`` fingerprint; None when none is set. A tier that
    cannot be opened is logged and left out (the engine runs without it); ``ConfigError`` without
    the model's identity."""
    if host_gib is None and disk_dir is None and store is None:
        return None
    if not model_identity:
        raise ConfigError("KV tiers need kv_model_identity (the loader sets it from the model directory)")
    ns = namespace(model_identity, layout)
    tiers: list[KVTier] = []
    for name, root, gib in ((HOST, host_dir if host_gib is not None else None, host_gib),
                            (DISK, disk_dir, disk_gib)):
        if root is None:
            continue
        try:
            tiers.append(FileTier(name, root, ns, int(gib * 2**30)))
            log.info("KV tier %s: %s, %.2f GiB", name, tiers[-1].directory, gib)
        except TierDownError as exc:
            log.warning("KV tier %s left out: %s", name, exc)
    if store is not None:
        try:
            tiers.append(MooncakeTier(parse_url(store), store_metadata or "", ns, int(store_segment_gib * 2**30)))
            log.info("KV tier store: %s, lending it %.2f GiB", store, store_segment_gib)
        except TierDownError as exc:
            log.warning("KV tier store left out: %s", exc)
    return TieredStore(tiers) if tiers else None
