"""Versioned KV events (producer) and the global KV index (consumer)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from xllm.kvstore import APPLIED, GAP, STALE, GlobalKVIndex, KVEventLog, block_hashes
from xllm.proto.kvstore.v1 import kv_events_pb2


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ---- KVEventLog -----------------------------------------------------------------------------

def test_versions_count_events_and_cached_set_follows():
    log = KVEventLog("a", 16, epoch=7)
    assert log.version == 0 and log.num_cached == 0
    log.record([(True, 1), (True, 2), (False, 1)])
    assert log.version == 3
    assert log.cached() == {2}


def test_delta_keeps_only_the_last_operation_per_hash():
    log = KVEventLog("a", 16, epoch=7)
    log.record([(True, 1), (True, 2)])
    log.record([(False, 1), (True, 3), (False, 3), (True, 1), (False, 2)])
    d = log.delta(2)
    assert (d.base_version, d.version, d.snapshot, d.epoch) == (2, 7, False, 7)
    assert list(d.stored) == [1] and list(d.removed) == [2, 3]
    assert (d.instance_id, d.block_size) == ("a", 16)


def test_delta_at_current_version_is_an_empty_ack():
    log = KVEventLog("a", 16)
    log.record([(True, 5)])
    d = log.delta(1)
    assert not d.snapshot and (d.base_version, d.version) == (1, 1)
    assert not d.stored and not d.removed


@pytest.mark.parametrize("since, epoch", [(None, None), (0, 99), (50, None)])
def test_unknown_epoch_none_or_future_version_gets_a_snapshot(since, epoch):
    log = KVEventLog("a", 16, epoch=7)
    log.record([(True, 1), (True, 2), (False, 2)])
    d = log.delta(since, epoch)
    assert d.snapshot and list(d.stored) == [1] and d.version == 3


def test_history_overflow_falls_back_to_a_snapshot():
    log = KVEventLog("a", 16, max_history=4)
    log.record([(True, h) for h in range(10)])
    assert log.can_delta(6) and not log.can_delta(5)
    assert not log.delta(6).snapshot
    snap = log.delta(2)
    assert snap.snapshot and list(snap.stored) == list(range(10))


@pytest.mark.parametrize("scoped", [False, True], ids=["own", "scoped"])
def test_any_interleaving_of_deltas_reproduces_the_producer_state(scoped):
    """Property: a consumer applying deltas taken at random points (some lost, then resynced)
    always ends with exactly the producer's cached set (a lower tier with a scope, alone in it, too)."""
    rng = random.Random(0)
    log = KVEventLog("w", 8, epoch=3, max_history=64)
    if scoped:
        log.tier_scopes = {"host": "file://m/shm", "disk": ""}
    index = GlobalKVIndex()
    acked = None
    tiers = ("", "host", "disk")  # the engine's memory and two lower tiers, on one version sequence
    for _ in range(300):
        log.record([(rng.random() < 0.6, rng.randrange(40)) for _ in range(rng.randrange(0, 6))],
                   tier=rng.choice(tiers))
        if rng.random() < 0.5:
            continue
        msg = log.delta(acked)
        acked = msg.version
        if rng.random() < 0.2:
            continue  # lost on the way
        if index.apply("w", msg) == GAP:
            known = index.version("w")
            resync = log.delta(known[1] if known else None, known[0] if known else None)
            assert index.apply("w", resync) == APPLIED
        for tier in tiers:
            assert {h for h in range(40) if "w" in index.holders(h, tier)} == set(log.cached(tier))
    assert index.gaps > 0


def test_match_tiers_continues_a_memory_hit_through_the_fastest_lower_tier_holding_each_block():
    idx = GlobalKVIndex()
    log = KVEventLog("a", 16, epoch=1)
    log.record([(True, 1), (True, 2)])
    assert log.record_tiers([("disk", True, 2), ("disk", True, 3), ("host", True, 4), ("disk", True, 4),
                             ("disk", True, 5), ("host", True, 9)]) == 6  # as a TieredStore drains them
    assert idx.apply("a", log.delta(None)) == APPLIED  # a snapshot carries every tier
    other = KVEventLog("b", 16, epoch=1)
    other.record([(True, 1)], tier="store")
    idx.apply("b", other.delta(None))
    m = idx.match_tiers([1, 2, 3, 4, 5, 6])
    assert (m["a"].device, m["a"].lower, m["a"].blocks) == (2, (("disk", 1), ("host", 1), ("disk", 1)), 5)
    assert (m["b"].device, m["b"].lower) == (0, (("store", 1),))
    assert set(idx.match_tiers([1, 2], instances={"a"})) == {"a"}
    log.record([(False, 4)], tier="host")
    log.record([(False, 3)], tier="disk")
    assert idx.apply("a", log.delta(idx.version("a")[1])) == APPLIED
    assert idx.match_tiers([1, 2, 3, 4])["a"].lower == ()
    idx.remove_instance("a")
    assert idx.holders(5, "disk") == frozenset() and idx.num_lower_blocks("a", "disk") == 0


def test_instances_sharing_a_tier_share_its_blocks_and_its_removals():
    """A store (or a host directory) named by the same scope: a block one instance lists there is loadable
    by every instance on it; a removal one of them reports holds for all; an instance on another store,
    or leaving, changes nothing for the others."""
    idx = GlobalKVIndex()
    logs = {w: KVEventLog(w, 16, epoch=1) for w in ("p", "d", "c", "x")}
    for w in ("p", "d", "c"):
        logs[w].tier_scopes = {"store": "mooncake://m:1/ns", "host": f"file://{w}/shm"}
    logs["x"].tier_scopes = {"store": "mooncake://other:1/ns"}
    logs["p"].record_tiers([("store", True, 1), ("store", True, 2), ("host", True, 3)])  # the prefill published
    logs["x"].record_tiers([("store", True, 3)])
    for w, log in logs.items():
        assert idx.apply(w, log.delta(None)) == APPLIED
    assert idx.match_tiers([1, 2, 3], {"c"})["c"].lower == (("store", 2),)  # c listed nothing, shares p's store
    assert idx.holders(2, "store") == frozenset({"p", "d", "c"})  # not x: another store
    assert idx.holders(3, "host") == frozenset({"p"})  # each host directory its own
    assert "x" not in idx.match_tiers([1, 2], {"x"})
    logs["d"].record_tiers([("store", False, 2)])  # d found block 2 missing (the master evicted it)
    assert idx.apply("d", logs["d"].delta(idx.version("d")[1])) == APPLIED
    assert idx.match_tiers([1, 2], {"p", "c"}) == {w: idx.match_tiers([1], {w})[w] for w in ("p", "c")}
    assert idx.holders(2, "store") == frozenset() and idx.num_lower_blocks("p", "store") == 1
    logs["c"].tier_scopes = {"store": "mooncake://other:1/ns"}  # c restarted on x's store
    logs["c"].epoch = 2
    assert idx.apply("c", logs["c"].delta(None)) == APPLIED
    assert idx.holders(3, "store") == frozenset({"x", "c"}) and idx.holders(1, "store") == frozenset({"p", "d"})
    idx.remove_instance("p")  # its listing leaves with it: nobody else listed block 1
    assert idx.holders(1, "store") == frozenset() and idx.holders(3, "store") == frozenset({"x", "c"})


# ---- GlobalKVIndex ----------------------------------------------------------------------------

def _delta(inst, epoch, base, version, stored=(), removed=()):
    return kv_events_pb2.KVCacheEvents(instance_id=inst, block_size=16, epoch=epoch, base_version=base,
                                       version=version, stored=stored, removed=removed)


def test_apply_deltas_detects_stale_and_gaps():
    idx = GlobalKVIndex()
    assert idx.apply("a", _delta("a", 1, 0, 2, stored=[10, 11])) == APPLIED
    assert idx.version("a") == (1, 2)
    assert idx.apply("a", _delta("a", 1, 0, 2, stored=[10, 11])) == STALE
    assert idx.apply("a", _delta("a", 1, 5, 6, stored=[12])) == GAP
    assert idx.gaps == 1
    # overlapping delta (base below known version) is safe to apply
    assert idx.apply("a", _delta("a", 1, 1, 4, stored=[11, 12], removed=[10])) == APPLIED
    assert idx.holders(10) == frozenset() and idx.holders(12) == {"a"}


def test_new_epoch_needs_a_snapshot_or_a_delta_from_zero():
    idx = GlobalKVIndex()
    idx.apply("a", _delta("a", 1, 0, 2, stored=[10, 11]))
    assert idx.apply("a", _delta("a", 2, 3, 4, stored=[12])) == GAP  # restarted instance
    assert idx.holders(10) == {"a"}  # old knowledge kept until resynchronised
    assert idx.apply("a", _delta("a", 2, 0, 1, stored=[12])) == APPLIED
    assert idx.holders(10) == frozenset() and idx.holders(12) == {"a"}


def test_snapshot_replaces_and_remove_instance_forgets():
    idx = GlobalKVIndex()
    idx.apply("a", _delta("a", 1, 0, 2, stored=[10, 11]))
    idx.apply("b", _delta("b", 9, 0, 1, stored=[10]))
    log = KVEventLog("a", 16, epoch=1)
    log.record([(True, 11), (True, 12), (True, 13)])
    assert idx.apply("a", log.snapshot()) == APPLIED
    assert idx.holders(10) == {"b"} and idx.holders(13) == {"a"}
    assert idx.num_blocks("a") == 3 and idx.num_blocks() == 4
    idx.remove_instance("a")
    assert idx.instances() == ["b"] and idx.holders(11) == frozenset()
    assert idx.num_blocks() == 1


def test_match_is_one_pass_over_the_prefix_for_all_instances():
    tokens = list(range(64))
    h = block_hashes(tokens, 16)  # 4 blocks
    idx = GlobalKVIndex()
    idx.apply("a", _delta("a", 1, 0, 1, stored=h[:3]))
    idx.apply("b", _delta("b", 1, 0, 1, stored=h[:1]))
    idx.apply("c", _delta("c", 1, 0, 1, stored=h[1:]))  # no first block: its later blocks are useless
    assert idx.match(h) == {"a": 3, "b": 1}
    assert idx.match(h, instances={"b", "c"}) == {"b": 1}
    assert idx.match(block_hashes([5] * 64, 16)) == {}
    assert idx.match([]) == {}


def test_expected_blocks_count_until_they_expire():
    clock = Clock()
    idx = GlobalKVIndex(clock=clock)
    h = block_hashes(list(range(48)), 16)
    idx.expect("b", h, ttl=2.0)
    assert idx.match(h) == {"b": 3}
    assert idx.match(h, expected=False) == {}
    clock.t += 3.0
    assert idx.match(h) == {}
    idx.prune()
    assert idx._expected == {}


def test_index_modules_import_without_torch():
    code = ("import sys, xllm.kvstore, xllm.kvstore.index, xllm.kvstore.events; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
