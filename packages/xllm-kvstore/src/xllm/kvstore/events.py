"""Versioned KV cache events of one engine instance (the producer side).

The engine's prefix cache reports ``(stored?, block_hash)`` events. :class:`KVEventLog`
numbers them (one version per event), keeps the set of blocks cached now and a bounded
history, and answers "what changed since version v?" with a compact delta: for every hash
touched after ``v`` only its last operation (see ``xllm.kvstore.v1.KVCacheEvents``). When the
asker is in another epoch (the instance restarted) or further behind than the history
reaches, the answer is a snapshot of the whole cache instead (RTP-LLM §5.2.1: versioned
cache keys, deltas when changed, a light acknowledgement when not).

The lower KV tiers an instance can load from (host DRAM, disk, the cluster store;
``xllm.kvstore.tiered``) are published on the same version sequence, keyed by tier: tier ``""``
is the engine's own memory (the message's ``stored``/``removed``), any other name one of its
``tiers`` entries. Every message also names the storage each lower tier is in (``tier_scopes``:
instances sharing a host directory or a cluster store share what is in it; ``xllm.kvstore.index``).

Not thread-safe: one thread records and answers (the engine server's event loop).
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Iterable

from xllm.proto.kvstore.v1 import kv_events_pb2


def new_epoch() -> int:
    """A random non-zero 63-bit epoch (0 means "knows nothing" to a consumer)."""
    return random.SystemRandom().getrandbits(63) | 1


DEVICE = ""  # the tier name of the engine's own KV memory


class KVEventLog:
    """The cache content of one instance, versioned, with delta and snapshot answers."""

    def __init__(self, instance_id: str, block_size: int, epoch: int | None = None,
                 max_history: int = 1 << 16) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.instance_id = instance_id
        self.block_size = block_size
        self.epoch = epoch if epoch is not None else new_epoch()
        self.version = 0
        self._cached: dict[str, set[int]] = {DEVICE: set()}  # tier -> blocks held there now
        self.tier_scopes: dict[str, str] = {}  # lower tier -> the storage it is in (KVCacheEvents.tier_scopes)
        # (version, stored?, hash, tier) for the most recent events
        self._history: deque[tuple[int, bool, int, str]] = deque(maxlen=max_history)

    def record(self, events: Iterable[tuple[bool, int]], tier: str = DEVICE) -> int:
        """Apply events of ``tier`` (default: the engine's own memory) in order; returns how many
        were recorded."""
        held = self._cached.setdefault(tier, set())
        n = 0
        for stored, block_hash in events:
            self.version += 1
            if stored:
                held.add(block_hash)
            else:
                held.discard(block_hash)
            self._history.append((self.version, bool(stored), block_hash, tier))
            n += 1
        return n

    def record_tiers(self, events: Iterable[tuple[str, bool, int]]) -> int:
        """Apply ``(tier, stored?, hash)`` events (``xllm.kvstore.tiered.TieredStore.drain_events``) in
        order, each run of one tier at once; returns how many were recorded."""
        return sum(self.record(((stored, h) for _, stored, h in run), tier=tier)
                   for tier, run in itertools.groupby(events, key=lambda e: e[0]))

    @property
    def num_cached(self) -> int:
        """Blocks in the engine's own memory."""
        return len(self._cached[DEVICE])

    def cached(self, tier: str = DEVICE) -> frozenset[int]:
        return frozenset(self._cached.get(tier, ()))

    def _message(self, **fields) -> kv_events_pb2.KVCacheEvents:
        return kv_events_pb2.KVCacheEvents(instance_id=self.instance_id, block_size=self.block_size,
                                           epoch=self.epoch, version=self.version, tier_scopes=self.tier_scopes,
                                           **fields)

    def snapshot(self) -> kv_events_pb2.KVCacheEvents:
        tiers = [kv_events_pb2.TierBlocks(tier=t, stored=sorted(held))
                 for t, held in sorted(self._cached.items()) if t != DEVICE and held]
        return self._message(snapshot=True, stored=sorted(self._cached[DEVICE]), tiers=tiers)

    def can_delta(self, since: int) -> bool:
        """Whether the history still holds every event after version ``since``."""
        if since > self.version:
            return False
        if since == self.version:
            return True
        oldest = self._history[0][0] if self._history else self.version + 1
        return since >= oldest - 1

    def delta(self, since: int | None, epoch: int | None = None) -> kv_events_pb2.KVCacheEvents:
        """Changes after version ``since`` of ``epoch`` (default: this epoch).

        ``since=None``, another epoch, a version from the future or one older than the
        history give a snapshot; ``since == version`` gives an empty delta (an ack).
        """
        if since is None or (epoch is not None and epoch != self.epoch) or not self.can_delta(since):
            return self.snapshot()
        last: dict[tuple[str, int], bool] = {}
        for version, stored, block_hash, tier in reversed(self._history):
            if version <= since:
                break
            last.setdefault((tier, block_hash), stored)
        by_tier: dict[str, tuple[list[int], list[int]]] = {}
        for (tier, h), s in last.items():
            by_tier.setdefault(tier, ([], []))[0 if s else 1].append(h)
        stored, removed = by_tier.pop(DEVICE, ([], []))
        tiers = [kv_events_pb2.TierBlocks(tier=t, stored=sorted(st), removed=sorted(rm))
                 for t, (st, rm) in sorted(by_tier.items())]
        return self._message(base_version=since, stored=sorted(stored), removed=sorted(removed), tiers=tiers)
