"""The tiers below an engine's KV memory as one store: lookups, loads and asynchronous write-down.

:class:`TieredStore` holds the lower tiers fastest first (T1 host, T2 disk, T3 store). The
hierarchy is inclusive: a block the engine evicts from its own memory is written to every tier
that lacks it (xLLM §3.4's "in a faster tier ⇒ also in the slower ones" rule, so the slower tiers
keep what the faster ones evict without moving blocks between tiers). Writes go through a queue
bounded in bytes to one writer thread: :meth:`write_down` only enqueues (full queue: the block is
dropped, never waited for); a block still queued is served from the queue itself.

A tier that fails (:class:`~xllm.kvstore.tier.TierDownError`) is skipped for ``retry_s`` and then
tried again: the engine carries on without it meanwhile (logged once per outage; ``up`` false in
its stats). Thread-safe.

:meth:`TieredStore.drain_events` says which blocks became loadable from (or left) each tier, as
``(tier, stored?, hash)``: what the instance publishes so the gateway's global KV index can weigh a
hit in a lower tier (``xllm.kvstore.index``). It starts with each tier's listing (a host tier that
outlived the previous engine process), then follows this process's writes and removals, and what its
lookups and loads find: a block found in a tier (stored there by another process or instance) is
published, and one found missing is withdrawn — a block this instance had published, and the first
block of a lookup that no tier holds (the index may believe another instance sharing the tier has it:
removals by other processes and by the store itself are seen no other way). Withdrawing that first
block ends the index's match for this prompt where the engine's own lookup ended.

:meth:`TieredStore.publish` stores blocks into one named tier at once (a prefill/decode hand-off
through the cluster store), :meth:`TieredStore.load_many` reads several blocks with one batch per tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from xllm.kvstore.tier import Buffers, CorruptBlockError, KVTier, TierDownError, TierStats

log = logging.getLogger(__name__)

PENDING = -1  # match(): the block is in the write queue, not yet in a tier


@dataclass
class StoreStats:
    """Store-wide counts beside the per-tier :class:`TierStats`."""

    queued_writes: int = 0
    dropped_writes: int = 0   # write queue full
    pending_hits: int = 0     # blocks served from the write queue


class TieredStore:
    """Lower KV tiers, fastest first (see the module docstring)."""

    def __init__(self, tiers: Sequence[KVTier], retry_s: float = 5.0, max_queued_bytes: int = 256 << 20) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must differ, got {names}")
        self.tiers = list(tiers)
        self.retry_s = retry_s
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self._pending: dict[int, bytes] = {}
        self._pending_bytes = 0
        self.max_queued_bytes = max_queued_bytes
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._stats = StoreStats()
        self._queries = {t.name: 0 for t in self.tiers}  # blocks looked up per tier (match)
        # (tier, stored?, hash) since drain_events; starts with what the tiers hold already
        self._events: list[tuple[str, bool, int]] = []
        self._published: dict[str, set[int]] = {t.name: set() for t in self.tiers}  # what the events say now
        for t in self.tiers:
            for h in _listing(t):
                self._note(t.name, True, h)
        self._writer = threading.Thread(target=self._write_loop, name="xllm-kv-writer", daemon=True)
        self._writer.start()

    # ---- tier health ----------------------------------------------------------------------------
    def is_up(self, tier: KVTier) -> bool:
        until = self._down_until.get(tier.name)
        return until is None or time.monotonic() >= until

    def _failed(self, tier: KVTier, exc: Exception) -> None:
        with self._lock:
            was_up = tier.name not in self._down_until
            self._down_until[tier.name] = time.monotonic() + self.retry_s
        if was_up:
            log.warning("KV tier %s is down, carrying on without it (retry in %.0f s): %s", tier.name,
                        self.retry_s, exc)

    def _worked(self, tier: KVTier) -> None:
        if tier.name in self._down_until:
            with self._lock:
                self._down_until.pop(tier.name, None)
            log.warning("KV tier %s is back", tier.name)

    # ---- lookups and loads (any thread) ---------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> list[int]:
        """For the leading blocks of ``hashes`` some tier holds: the index of the fastest tier holding
        each (:data:`PENDING` for a block still in the write queue); stops at the first block none has.
        Each tier is asked once, for the blocks the faster ones lack (one round trip for a remote tier).
        What the tiers answer corrects the published events (see the module docstring)."""
        where: list[int | None] = [None] * len(hashes)
        with self._lock:
            for j, h in enumerate(hashes):
                if h in self._pending:
                    where[j] = PENDING
        absent: list[tuple[str, list[int]]] = []  # (tier, positions it answered "absent" for)
        for i, tier in enumerate(self.tiers):
            if not self.is_up(tier):
                continue
            ask = [j for j, w in enumerate(where) if w is None]
            if not ask:
                break
            with self._lock:
                self._queries[tier.name] += len(ask)
            try:
                found = tier.contains_many([hashes[j] for j in ask])
            except TierDownError as exc:
                self._failed(tier, exc)
                continue
            misses = []
            for j, hit in zip(ask, found, strict=True):
                if hit:
                    where[j] = i
                else:
                    misses.append(j)
            absent.append((tier.name, misses))
        out: list[int] = []
        for w in where:
            if w is None:
                break
            out.append(w)
        first_miss = len(out) if len(out) < len(hashes) else None
        with self._lock:
            for j, w in enumerate(where):
                if w is not None and w != PENDING:
                    self._note(self.tiers[w].name, True, hashes[j])
            for name, misses in absent:
                for j in misses:
                    self._note(name, False, hashes[j], always=j == first_miss)
        return out

    def stored_everywhere(self, block_hash: int) -> bool:
        """Whether writing the block down would change nothing: it is queued, or every tier that is up
        holds it. Asks only local tiers (the engine thread calls this per evicted block): with a
        remote tier up, False."""
        with self._lock:
            if block_hash in self._pending:
                return True
        up = [tier for tier in self.tiers if self.is_up(tier)]
        return not any(t.remote for t in up) and all(self._contains(t, block_hash) for t in up)

    def _contains(self, tier: KVTier, block_hash: int) -> bool:
        try:
            return tier.contains(block_hash)
        except TierDownError as exc:
            self._failed(tier, exc)
            return False

    def load_into(self, block_hash: int, dest: Buffers) -> str | None:
        """Read the block into ``dest`` from the write queue or the fastest tier that has it intact;
        returns where it came from (``"queue"`` or a tier name), or None: no tier has it intact (a
        corrupt copy is dropped from its tier and the next tier is tried)."""
        with self._lock:
            payload = self._pending.get(block_hash)
            if payload is not None:
                self._stats.pending_hits += 1
        if payload is not None:
            _scatter(payload, dest)
            return "queue"
        for tier in self.tiers:
            if not self.is_up(tier):
                continue
            try:
                if tier.get_into(block_hash, dest):
                    self._worked(tier)
                    with self._lock:
                        self._note(tier.name, True, block_hash)
                    return tier.name
                with self._lock:
                    self._note(tier.name, False, block_hash)  # gone since it was listed or looked up
            except CorruptBlockError:
                self._drain_dropped(tier)
                continue
            except TierDownError as exc:
                self._failed(tier, exc)
        return None

    def load_many(self, hashes: Sequence[int], dests: Sequence[Buffers]) -> int:
        """Read blocks ``hashes`` into ``dests`` (one batch per tier, fastest tier first, each asked for
        the blocks the faster ones did not deliver intact); returns how many leading blocks arrived
        intact (a block that did not is recomputed, or sent another way, by the caller)."""
        done = [False] * len(hashes)
        with self._lock:
            queued = [self._pending.get(h) for h in hashes]
            self._stats.pending_hits += sum(1 for q in queued if q is not None)
        for j, payload in enumerate(queued):
            if payload is not None:
                _scatter(payload, dests[j])
                done[j] = True
        for tier in self.tiers:
            ask = [j for j, ok in enumerate(done) if not ok]
            if not ask:
                break
            if not self.is_up(tier):
                continue
            try:
                got = tier.get_many_into([hashes[j] for j in ask], [dests[j] for j in ask])
            except TierDownError as exc:
                self._failed(tier, exc)
                continue
            except Exception:  # a tier's bug: the blocks are recomputed, never trusted
                log.exception("KV tier %s: loading %d blocks failed", tier.name, len(ask))
                continue
            self._worked(tier)
            self._drain_dropped(tier)  # (a corrupt block was dropped)
            with self._lock:
                for j, ok in zip(ask, got, strict=True):
                    done[j] = ok
                    self._note(tier.name, ok, hashes[j])
        return next((j for j, ok in enumerate(done) if not ok), len(hashes))

    def publish(self, tier_name: str, blocks: Sequence[tuple[int, bytes]]) -> list[bool]:
        """Store ``(hash, payload)`` blocks into tier ``tier_name`` now (one lookup and one batch put),
        skipping those it holds already; says per block whether the tier holds it afterwards (all False
        when the tier is absent, down or failing: the caller moves the blocks another way)."""
        tier = next((t for t in self.tiers if t.name == tier_name), None)
        if tier is None or not self.is_up(tier) or not blocks:
            return [False] * len(blocks)
        try:
            there = tier.contains_many([h for h, _ in blocks])
            missing = [j for j, ok in enumerate(there) if not ok]
            stored = tier.put_many([(blocks[j][0], [blocks[j][1]]) for j in missing])
        except TierDownError as exc:
            self._failed(tier, exc)
            return [False] * len(blocks)
        self._worked(tier)
        self._drain_dropped(tier)
        for j, ok in zip(missing, stored, strict=True):
            there[j] = ok
        with self._lock:
            for (h, _), ok in zip(blocks, there, strict=True):
                if ok:
                    self._note(tier.name, True, h)
        return list(there)

    def scopes(self) -> dict[str, str]:
        """Each tier's :attr:`~xllm.kvstore.tier.KVTier.scope`, by tier name."""
        return {t.name: t.scope for t in self.tiers}

    # ---- write-down ------------------------------------------------------------------------------
    def write_down(self, block_hash: int, payload: bytes) -> bool:
        """Queue an evicted block for every tier lacking it; False when the queue is full (dropped)
        or the block is already queued. Never blocks."""
        with self._lock:
            if block_hash in self._pending:
                return False
            if self._pending and self._pending_bytes + len(payload) > self.max_queued_bytes:
                self._stats.dropped_writes += 1
                return False
            self._queue.put_nowait((block_hash, payload))
            self._pending[block_hash] = payload
            self._pending_bytes += len(payload)
            self._stats.queued_writes += 1
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or given up); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            block_hash, payload = item
            try:
                for tier in self.tiers:
                    if not self.is_up(tier):
                        continue
                    try:
                        stored = tier.contains(block_hash) or tier.put(block_hash, [payload])
                        self._drain_dropped(tier)  # what the put evicted for room comes first
                        if stored:
                            with self._lock:
                                self._note(tier.name, True, block_hash)
                        self._worked(tier)
                    except TierDownError as exc:
                        self._failed(tier, exc)
                    except Exception:  # a tier's bug must not kill the writer
                        log.exception("KV tier %s: writing block %016x failed", tier.name, block_hash)
            finally:
                with self._idle:
                    self._pending.pop(block_hash, None)
                    self._pending_bytes -= len(payload)
                    if not self._pending:
                        self._idle.notify_all()

    # ---- reports and shutdown -------------------------------------------------------------------------
    def drain_events(self) -> list[tuple[str, bool, int]]:
        """``(tier name, stored?, block hash)`` in order since the last call: blocks this process wrote
        to (or found in) a tier, and blocks it removed from one (see the module docstring)."""
        for tier in self.tiers:
            self._drain_dropped(tier)
        with self._lock:
            out, self._events = self._events, []
        return out

    def _drain_dropped(self, tier: KVTier) -> None:
        """Publish the blocks ``tier`` says this process removed (right after the operation that may have
        removed them, so a removal is never published after a later store of the same block)."""
        try:
            dropped = tier.drain_dropped()
        except Exception:  # a tier's bug must not break the engine's reports
            log.exception("KV tier %s: listing removed blocks failed", tier.name)
            return
        with self._lock:  # (always published: the block may be another instance's, in a shared tier)
            for h in dropped:
                self._note(tier.name, False, h, always=True)

    def _note(self, tier: str, stored: bool, block_hash: int, always: bool = False) -> None:
        """Record an event when it changes what this instance publishes about ``tier`` (``always``: a
        removal even of a block it never published). Caller holds the lock (or is the constructor)."""
        held = self._published[tier]
        if stored and block_hash not in held:
            held.add(block_hash)
        elif not stored and (block_hash in held or always):
            held.discard(block_hash)
        else:
            return
        self._events.append((tier, stored, block_hash))

    def stats(self) -> dict[str, TierStats]:
        """Each tier's cumulative counts (``up``: not in an outage now), by tier name."""
        out = {}
        for tier in self.tiers:
            s = tier.stats()
            s.up = self.is_up(tier)
            with self._lock:
                s.queries = self._queries[tier.name]
            out[tier.name] = s
        return out

    @property
    def store_stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(**vars(self._stats))

    def close(self, flush_timeout: float = 10.0) -> None:
        """Write what is queued (up to ``flush_timeout``), stop the writer, close the tiers."""
        if not self.flush(flush_timeout):
            log.warning("KV tiers: the writer did not drain its queue in %.0f s; closing anyway", flush_timeout)
        self._queue.put(None)
        self._writer.join(flush_timeout)
        for tier in self.tiers:
            tier.close()


def _scatter(payload: bytes, dest: Buffers) -> None:
    at, view = 0, memoryview(payload)
    for d in dest:
        n = len(d)
        d[:] = view[at:at + n]
        at += n
    if at != len(payload):
        raise ValueError(f"a {len(payload)}-byte block into {at} bytes of pages")


def _listing(tier: KVTier) -> list[int]:
    try:
        return tier.listing()
    except Exception:  # an unreadable tier publishes nothing up front
        log.exception("KV tier %s: listing its blocks failed", tier.name)
        return []
