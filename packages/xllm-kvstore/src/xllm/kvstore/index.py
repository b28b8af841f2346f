"""The global KV index: one hash map from block hash to the instances holding that block.

RTP-LLM §5.2.1–5.2.2: instead of one map per worker (O(blocks × workers) to match a
request), the cache keys of all instances are merged into a single map, so matching a
request's prefix is one pass over its block hashes for every instance at once (Algorithm 2).

Fed by :class:`~xllm.proto.kvstore.v1.kv_events_pb2.KVCacheEvents` from the instances'
heartbeats. Each instance's (epoch, version) is tracked: a delta whose ``base_version`` is
above the known version reveals missed events (:data:`GAP`), and the caller resynchronises
with a newer delta or a snapshot from the instance.

Besides confirmed blocks the index keeps short-lived *expected* ones: when the router sends a
request to an instance, that instance will hold the request's prefix blocks a moment later,
before its next heartbeat says so. Counting them lets a burst of requests sharing a new
prefix follow the first one instead of scattering.

Besides each instance's own KV memory the index records the blocks it can load from the tiers
below it (host DRAM, local disk, the cluster store: the events' ``tiers``): :meth:`match_tiers`
says, per instance, how deep the prompt's prefix reaches in its memory and how many blocks after
that it could bring up from which tier, so the router can weigh a deep hit in a slow tier against
a shallow hit in memory by predicted TTFT (RTP-LLM's cache-aware balancing;
``xllm.sched.routing``).

Lower tiers can be shared: the engine processes of one machine share a host directory, every
instance of a cluster the Mooncake store. The events name each tier's storage (``tier_scopes``), and
instances naming the same scope share its blocks here: a block one of them lists in a shared tier
counts as loadable by all of them (a prefill instance's hand-off published to the store is a T3 hit
for every instance on that store), and a removal one of them reports there (an eviction, a lookup
that found the block missing) holds for all of them.

Pure Python, no torch. Not thread-safe: used from the gateway's event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from xllm.kvstore.tier import TIER_ORDER
from xllm.proto.kvstore.v1 import kv_events_pb2

APPLIED = "applied"  # the instance's state moved to the message's version
STALE = "stale"      # nothing new (an old or duplicate message)
GAP = "gap"          # events were missed: resynchronise from the instance


@dataclass(frozen=True)
class TierMatch:
    """How far a prompt's prefix reaches on one instance: ``device`` leading blocks in its KV memory,
    then ``lower`` — (tier, blocks) runs in prompt order, each block counted in the fastest lower
    tier holding it — that it would load instead of recomputing."""

    device: int = 0
    lower: tuple[tuple[str, int], ...] = ()

    @property
    def blocks(self) -> int:
        return self.device + sum(n for _, n in self.lower)


def _tier_rank(tier: str) -> int:
    return TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)


class GlobalKVIndex:
    """Block hash -> set of instance ids, with per-instance versions (and the same per lower tier)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._holders: dict[int, set[str]] = {}
        self._held: dict[str, set[int]] = {}
        # the lower tiers: hash -> {instance: tiers holding it}, and instance -> tier -> hashes
        self._lower_holders: dict[int, dict[str, set[str]]] = {}
        self._lower_held: dict[str, dict[str, set[int]]] = {}
        # shared lower tiers: instance -> {tier: scope}, scope -> its (instance, tier) members, and
        # scope -> {hash: how many members list it}
        self._scopes: dict[str, dict[str, str]] = {}
        self._scope_members: dict[str, set[tuple[str, str]]] = {}
        self._scope_blocks: dict[str, dict[int, int]] = {}
        self._versions: dict[str, tuple[int, int]] = {}
        self._expected: dict[int, dict[str, float]] = {}  # hash -> {instance: expiry}
        self._clock = clock
        self.gaps = 0

    # ---- feeding ------------------------------------------------------------------------
    def version(self, instance_id: str) -> tuple[int, int] | None:
        """``(epoch, version)`` known for ``instance_id``, or None."""
        return self._versions.get(instance_id)

    def apply(self, instance_id: str, ev: kv_events_pb2.KVCacheEvents) -> str:
        """Apply a delta or snapshot; returns :data:`APPLIED`, :data:`STALE` or :data:`GAP`."""
        known = self._versions.get(instance_id)
        if ev.snapshot:
            if known is not None and known[0] == ev.epoch and ev.version < known[1]:
                return STALE
            self._set_scopes(instance_id, dict(ev.tier_scopes))
            self._replace(instance_id, set(ev.stored))
            self._replace_lower(instance_id, {t.tier: set(t.stored) for t in ev.tiers})
            self._versions[instance_id] = (ev.epoch, ev.version)
            return APPLIED
        if known is None or known[0] != ev.epoch:
            # a delta of an epoch we know nothing of: only a delta from the very start will do
            if ev.base_version != 0:
                self.gaps += 1
                return GAP
            self._replace(instance_id, set())
            self._replace_lower(instance_id, {})
            known = (ev.epoch, 0)
        if ev.version <= known[1]:
            return STALE
        if ev.base_version > known[1]:
            self.gaps += 1
            return GAP
        self._set_scopes(instance_id, dict(ev.tier_scopes))
        for h in ev.removed:
            self._drop(instance_id, h)
        for h in ev.stored:
            self._add(instance_id, h)
        for t in ev.tiers:
            for h in t.removed:
                self._drop_shared(instance_id, t.tier, h)
            for h in t.stored:
                self._add_lower(instance_id, t.tier, h)
        self._versions[instance_id] = (ev.epoch, ev.version)
        return APPLIED

    def remove_instance(self, instance_id: str) -> None:
        """Forget everything about ``instance_id`` (it left the cluster)."""
        for h in self._held.pop(instance_id, set()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(instance_id)
                if not holders:
                    del self._holders[h]
        self._replace_lower(instance_id, {})
        self._set_scopes(instance_id, {})
        self._lower_held.pop(instance_id, None)
        self._versions.pop(instance_id, None)
        for h in [h for h, exp in self._expected.items() if instance_id in exp]:
            exp = self._expected[h]
            exp.pop(instance_id, None)
            if not exp:
                del self._expected[h]

    def expect(self, instance_id: str, hashes: Sequence[int], ttl: float = 5.0) -> None:
        """Note that ``instance_id`` is about to cache ``hashes`` (a request was routed there)."""
        until = self._clock() + ttl
        for h in hashes:
            self._expected.setdefault(h, {})[instance_id] = until

    def prune(self) -> None:
        """Drop expired expectations (matching ignores them anyway; this frees memory)."""
        now = self._clock()
        for h in [h for h, exp in self._expected.items() if all(t <= now for t in exp.values())]:
            del self._expected[h]

    # ---- matching -----------------------------------------------------------------------
    def match(self, hashes: Sequence[int], instances: Collection[str] | None = None,
              expected: bool = True) -> dict[str, int]:
        """Leading blocks of ``hashes`` each instance holds: ``{instance: blocks}``.

        One pass over the hashes for all instances at once (RTP-LLM Algorithm 2). Unlike the
        paper's version, an instance counts only while it holds *every* block so far: with
        chained hashes a block past a missing one cannot be reused, so it is not a match.
        Instances with no leading block are left out. ``instances`` restricts the result.
        """
        now = self._clock()
        alive: set[str] | None = None
        result: dict[str, int] = {}
        for i, h in enumerate(hashes):
            holders = self._holders.get(h, set())
            if expected:
                exp = self._expected.get(h)
                if exp:
                    holders = holders | {w for w, t in exp.items() if t > now}
            if alive is None:
                alive = set(holders) if instances is None else {w for w in holders if w in instances}
            else:
                alive &= holders
            if not alive:
                break
            for w in alive:
                result[w] = i + 1
        return result

    def match_tiers(self, hashes: Sequence[int], instances: Collection[str] | None = None,
                    expected: bool = True) -> dict[str, TierMatch]:
        """Per instance, the prompt's leading blocks in its memory (as :meth:`match`) and then the
        blocks it can load from its lower tiers, each from the fastest tier holding it; a block no tier
        of the instance holds ends its prefix. Instances with neither are left out."""
        device = self.match(hashes, instances, expected)
        out = {w: TierMatch(n) for w, n in device.items()}
        known = self._lower_held.keys() | self._scopes.keys()
        lower_ids = list(known) if instances is None else [w for w in instances if w in known]
        for w in lower_ids:
            runs: list[tuple[str, int]] = []
            shared = [(t, self._scope_blocks.get(s, {})) for t, s in self._scopes.get(w, {}).items()]
            for h in hashes[device.get(w, 0):]:
                tiers = self._lower_holders.get(h, {}).get(w, set())
                if shared:
                    tiers = tiers | {t for t, blocks in shared if h in blocks}
                if not tiers:
                    break
                tier = min(tiers, key=_tier_rank)
                if runs and runs[-1][0] == tier:
                    runs[-1] = (tier, runs[-1][1] + 1)
                else:
                    runs.append((tier, 1))
            if runs:
                out[w] = TierMatch(device.get(w, 0), tuple(runs))
        return out

    # ---- introspection ------------------------------------------------------------------
    def num_blocks(self, instance_id: str | None = None) -> int:
        """Blocks confirmed held by ``instance_id`` (or distinct blocks held anywhere)."""
        if instance_id is None:
            return len(self._holders)
        return len(self._held.get(instance_id, ()))

    def num_lower_blocks(self, instance_id: str, tier: str) -> int:
        """Blocks ``instance_id`` reports it can load from its lower tier ``tier``."""
        return len(self._lower_held.get(instance_id, {}).get(tier, ()))

    def holders(self, block_hash: int, tier: str = "") -> frozenset[str]:
        """Instances holding the block in their memory (``tier=""``), or able to load it from their lower tier
        ``tier`` (listed by them, or by another instance sharing that tier's storage)."""
        if tier:
            own = {w for w, ts in self._lower_holders.get(block_hash, {}).items() if tier in ts}
            shared = {w for w, scopes in self._scopes.items()
                      if tier in scopes and block_hash in self._scope_blocks.get(scopes[tier], {})}
            return frozenset(own | shared)
        return frozenset(self._holders.get(block_hash, ()))

    def instances(self) -> list[str]:
        return sorted(self._versions)

    # ---- internals ----------------------------------------------------------------------
    def _add(self, instance_id: str, h: int) -> None:
        self._holders.setdefault(h, set()).add(instance_id)
        self._held.setdefault(instance_id, set()).add(h)

    def _drop(self, instance_id: str, h: int) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(instance_id)
            if not holders:
                del self._holders[h]
        held = self._held.get(instance_id)
        if held is not None:
            held.discard(h)

    def _replace(self, instance_id: str, blocks: set[int]) -> None:
        old = self._held.get(instance_id, set())
        for h in old - blocks:
            self._drop(instance_id, h)
        for h in blocks - old:
            self._add(instance_id, h)
        self._held.setdefault(instance_id, set())

    def _add_lower(self, instance_id: str, tier: str, h: int) -> None:
        held = self._lower_held.setdefault(instance_id, {}).setdefault(tier, set())
        if h in held:
            return
        held.add(h)
        self._lower_holders.setdefault(h, {}).setdefault(instance_id, set()).add(tier)
        scope = self._scopes.get(instance_id, {}).get(tier)
        if scope:
            blocks = self._scope_blocks.setdefault(scope, {})
            blocks[h] = blocks.get(h, 0) + 1

    def _drop_shared(self, instance_id: str, tier: str, h: int) -> None:
        """``instance_id`` says ``h`` left its tier ``tier``: from every member of that tier's scope."""
        scope = self._scopes.get(instance_id, {}).get(tier)
        if not scope:
            self._drop_lower(instance_id, tier, h)
            return
        for w, t in list(self._scope_members.get(scope, ())):
            self._drop_lower(w, t, h)

    def _set_scopes(self, instance_id: str, scopes: dict[str, str]) -> None:
        """Record which storage each of the instance's lower tiers is in (moving its blocks' counts)."""
        scopes = {t: s for t, s in scopes.items() if s}
        old = self._scopes.get(instance_id, {})
        if scopes == old:
            return
        held = self._lower_held.get(instance_id, {})
        for tier, scope in old.items():
            self._scope_members[scope].discard((instance_id, tier))
            blocks = self._scope_blocks.get(scope, {})
            for h in held.get(tier, ()):
                n = blocks.get(h, 0) - 1
                if n > 0:
                    blocks[h] = n
                else:
                    blocks.pop(h, None)
            if not self._scope_members[scope]:
                del self._scope_members[scope]
                self._scope_blocks.pop(scope, None)
        if scopes:
            self._scopes[instance_id] = scopes
        else:
            self._scopes.pop(instance_id, None)
        for tier, scope in scopes.items():
            self._scope_members.setdefault(scope, set()).add((instance_id, tier))
            blocks = self._scope_blocks.setdefault(scope, {})
            for h in held.get(tier, ()):
                blocks[h] = blocks.get(h, 0) + 1

    def _drop_lower(self, instance_id: str, tier: str, h: int) -> None:
        held = self._lower_held.get(instance_id, {}).get(tier)
        if held is None or h not in held:
            return
        held.discard(h)
        scope = self._scopes.get(instance_id, {}).get(tier)
        if scope:
            blocks = self._scope_blocks.get(scope, {})
            n = blocks.get(h, 0) - 1
            if n > 0:
                blocks[h] = n
            else:
                blocks.pop(h, None)
        by_instance = self._lower_holders.get(h)
        if by_instance is not None:
            tiers = by_instance.get(instance_id)
            if tiers is not None:
                tiers.discard(tier)
                if not tiers:
                    del by_instance[instance_id]
            if not by_instance:
                del self._lower_holders[h]

    def _replace_lower(self, instance_id: str, blocks: dict[str, set[int]]) -> None:
        old = self._lower_held.get(instance_id, {})
        for tier in set(old) | set(blocks):
            have, want = set(old.get(tier, ())), blocks.get(tier, set())
            for h in have - want:
                self._drop_lower(instance_id, tier, h)
            for h in want - have:
                self._add_lower(instance_id, tier, h)
