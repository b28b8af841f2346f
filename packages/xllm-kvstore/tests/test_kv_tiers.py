"""The KV tiers below engine memory, torch-free: file tiers (capacity, LRU, checks across processes'
views of one directory) and the tiered store (write-down queue, outages)."""

import os
import pathlib
import subprocess
import sys

import pytest

from xllm.kvstore.file_tier import FileTier
from xllm.kvstore.tier import HEADER_BYTES, CorruptBlockError, TierDownError, TierStats, model_identity, namespace
from xllm.kvstore.tiered import PENDING, TieredStore

BLOCK = 1000
NS = namespace("model-a", "2L2H8K8V/float32/16")


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(BLOCK))


def read(tier, h: int) -> bytes | None:
    dest = [memoryview(bytearray(400)), memoryview(bytearray(BLOCK - 400))]
    return b"".join(bytes(d) for d in dest) if tier.get_into(h, dest) else None


def test_blocks_round_trip_in_pieces_and_survive_a_reopen(tmp_path):
    tier = FileTier("disk", tmp_path, NS, 100 * BLOCK)
    assert tier.put(1, [payload(1)[:10], payload(1)[10:]]) is True
    assert tier.put(1, [payload(1)]) is False  # already there
    assert tier.contains(1) and not tier.contains(2)
    assert read(tier, 1) == payload(1)
    assert read(tier, 2) is None
    tier.close()
    again = FileTier("disk", tmp_path, NS, 100 * BLOCK)  # a restarted engine on the same directory
    assert read(again, 1) == payload(1)
    s = again.stats()
    assert (s.hits, s.bytes_read, s.used_bytes) == (1, BLOCK, HEADER_BYTES + BLOCK)


def test_a_full_tier_evicts_the_least_recently_used_block(tmp_path):
    tier = FileTier("host", tmp_path, NS, 3 * (HEADER_BYTES + BLOCK), low_water=1.0)
    for h in (1, 2, 3):
        tier.put(h, [payload(h)])
        os.utime(tier.path(h), ns=(h * 10**9, h * 10**9))  # distinct times whatever the clock's resolution
    assert read(tier, 1) == payload(1)  # 1 is now the most recently used: 2 is the oldest
    tier.put(4, [payload(4)])
    assert [tier.contains(h) for h in (1, 2, 3, 4)] == [True, False, True, True]
    tier.put(5, [payload(5)])
    assert [tier.contains(h) for h in (1, 3, 4, 5)] == [True, False, True, True]
    s = tier.stats()
    assert s.evictions == 2 and s.used_bytes == 3 * (HEADER_BYTES + BLOCK) <= s.capacity_bytes


def test_the_store_publishes_what_each_tier_gains_and_loses_starting_from_what_it_holds(tmp_path):
    """The events an instance publishes for the gateway's index (xllm.kvstore.events): a tier's
    existing blocks first (a host tier outliving the engine), then writes, capacity evictions and
    dropped damaged blocks, each named by tier."""
    host = FileTier("host", tmp_path / "h", NS, 2 * (HEADER_BYTES + BLOCK), low_water=1.0)
    host.put(7, [payload(7)])
    os.utime(host.path(7), ns=(10**9, 10**9))  # the oldest: evicted first
    disk = FileTier("disk", tmp_path / "d", NS, 100 * BLOCK)
    store = TieredStore([host, disk], retry_s=0.0)
    try:
        assert store.drain_events() == [("host", True, 7)]
        for h in (1, 2):
            assert store.write_down(h, payload(h))
            assert store.flush(10)
        events = store.drain_events()
        assert sorted(e for e in events if e[1]) == [("disk", True, 1), ("disk", True, 2), ("host", True, 1),
                                                     ("host", True, 2)]
        assert [e for e in events if not e[1]] == [("host", False, 7)]  # made room for block 2
        with open(disk.path(1), "r+b") as f:  # damage: the failed check drops it, and says so
            f.seek(HEADER_BYTES + 3)
            f.write(b"\xff")
        with pytest.raises(CorruptBlockError):
            disk.get_into(1, [memoryview(bytearray(BLOCK))])
        assert store.drain_events() == [("disk", False, 1)]
        assert store.drain_events() == []
    finally:
        store.close()


def test_lookups_and_loads_correct_what_the_store_publishes(tmp_path):
    """Blocks another process put into a shared tier are published once a lookup finds them; a block this
    instance published that another process removed is withdrawn when a lookup or load misses it; the
    first block of a lookup that no tier holds is withdrawn even if never published (the index may hold it
    for another instance sharing the tier). Known blocks are published once."""
    mine = FileTier("host", tmp_path, NS, 100 * BLOCK)
    theirs = FileTier("host", tmp_path, NS, 100 * BLOCK)  # another engine process on the same directory
    store = TieredStore([mine], retry_s=0.0)
    try:
        assert store.drain_events() == [] and store.scopes() == {"host": mine.scope} and mine.scope == theirs.scope
        for h in (1, 2, 3):
            theirs.put(h, [payload(h)])
        assert store.match([1, 2, 3, 4, 5]) == [0, 0, 0]
        assert store.drain_events() == [("host", True, 1), ("host", True, 2), ("host", True, 3), ("host", False, 4)]
        assert store.match([1, 2]) == [0, 0] and store.drain_events() == []  # nothing new
        assert theirs.evict(2) and theirs.evict(3)  # the other process evicts two of them
        assert store.match([1, 2]) == [0] and store.drain_events() == [("host", False, 2)]
        dest = [[memoryview(bytearray(BLOCK))] for _ in range(2)]
        assert store.load_many([1, 3], dest) == 1 and bytes(dest[0][0]) == payload(1)
        assert store.drain_events() == [("host", False, 3)]  # the load found it gone
        assert store.publish("host", [(3, payload(3)), (1, payload(1))]) == [True, True]
        assert store.drain_events() == [("host", True, 3)] and theirs.contains(3)
        assert store.publish("store", [(5, payload(5))]) == [False]  # no such tier: the caller goes another way
    finally:
        store.close()


def test_capacity_is_shared_by_every_process_using_the_directory(tmp_path):
    size = HEADER_BYTES + BLOCK
    mine = FileTier("host", tmp_path, NS, 2 * size, low_water=1.0)
    mine.put(1, [payload(1)])
    os.utime(mine.path(1), ns=(10**9, 10**9))
    code = (f"from xllm.kvstore.file_tier import FileTier; from xllm.kvstore.tier import namespace\n"
            f"t = FileTier('host', {str(tmp_path)!r}, namespace('model-a', '2L2H8K8V/float32/16'), {2 * size}, 1.0)\n"
            f"t.put(2, [bytes({BLOCK})])")
    subprocess.run([sys.executable, "-c", code], check=True)  # another engine process, since gone
    assert mine.contains(2)  # its block outlives it
    mine.put(3, [payload(3)])  # over the shared capacity: the oldest block (1) goes
    assert [mine.contains(h) for h in (1, 2, 3)] == [False, True, True]
    assert mine.stats().used_bytes == 2 * size


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_hash", "other_model"])
def test_a_damaged_or_foreign_block_is_detected_and_dropped(tmp_path, damage):
    tier = FileTier("disk", tmp_path, NS, 100 * BLOCK)
    tier.put(1, [payload(1)])
    tier.put(2, [payload(2)])
    path = tier.path(1)
    raw = bytearray(pathlib.Path(path).read_bytes())
    if damage == "flip":
        raw[HEADER_BYTES + 500] ^= 0x01
    elif damage == "truncate":
        raw = raw[:-1]
    elif damage == "other_hash":  # a valid record of block 2 under block 1's name
        raw = bytearray(pathlib.Path(tier.path(2)).read_bytes())
    else:  # the same hash written by another model (another namespace) into this directory
        other = FileTier("disk", tmp_path / "other", namespace("model-b", "2L2H8K8V/float32/16"), 100 * BLOCK)
        other.put(1, [payload(1)])
        raw = bytearray(pathlib.Path(other.path(1)).read_bytes())
    with open(path, "wb") as f:
        f.write(raw)
    with pytest.raises(CorruptBlockError):
        read(tier, 1)
    assert not tier.contains(1) and tier.stats().corrupt == 1
    assert read(tier, 2) == payload(2)


def test_namespaces_separate_models_and_layouts(tmp_path):
    a = FileTier("disk", tmp_path, namespace("model-a", "L/float32/16"), 100 * BLOCK)
    b = FileTier("disk", tmp_path, namespace("model-a", "L/bfloat16/16"), 100 * BLOCK)
    a.put(1, [payload(1)])
    assert a.contains(1) and not b.contains(1)
    with pytest.raises(ValueError):
        namespace("", "L/float32/16")


def test_model_identity_tells_fine_tunes_apart(tmp_path):
    for name, byte in (("a", 1), ("b", 2)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text('{"hidden_size": 8}')
        (d / "model.safetensors").write_bytes(bytes([0] * 5000 + [byte] + [0] * 5000))
    assert model_identity(tmp_path / "a") != model_identity(tmp_path / "b")
    assert model_identity(tmp_path / "a") == model_identity(tmp_path / "a")


class FlakyTier:
    """A tier whose every operation fails while ``down`` (an unreachable store)."""

    def __init__(self) -> None:
        self.name, self.down, self.blocks = "store", True, {}

    def put(self, h, pieces):
        if self.down:
            raise TierDownError("store unreachable")
        self.blocks[h] = b"".join(bytes(p) for p in pieces)
        return True

    def get_into(self, h, dest):
        if self.down:
            raise TierDownError("store unreachable")
        if h not in self.blocks:
            return False
        at = 0
        for d in dest:
            d[:] = self.blocks[h][at:at + len(d)]
            at += len(d)
        return True

    remote = True

    def contains(self, h):
        if self.down:
            raise TierDownError("store unreachable")
        return h in self.blocks

    def contains_many(self, hs):
        return [self.contains(h) for h in hs]

    def evict(self, h):
        return self.blocks.pop(h, None) is not None

    def drain_dropped(self):
        return []

    def listing(self):
        return []

    capacity_bytes = 1 << 30

    def stats(self):
        return TierStats()

    def close(self):
        pass


def test_write_down_serves_queued_blocks_and_carries_on_without_a_down_tier(tmp_path):
    disk = FileTier("disk", tmp_path, NS, 100 * BLOCK)
    flaky = FlakyTier()
    store = TieredStore([flaky, disk], retry_s=0.0)
    try:
        assert store.write_down(1, payload(1)) is True
        assert store.flush(10)
        assert disk.contains(1) and not flaky.blocks  # the down tier was skipped, the disk got it
        assert store.match([1, 2]) == [1]
        dest = [memoryview(bytearray(BLOCK))]
        assert store.load_into(1, dest) == "disk" and bytes(dest[0]) == payload(1)
        flaky.down = False  # back: retried at once (retry_s=0) and used again
        store.write_down(2, payload(2))
        assert store.flush(10)
        assert flaky.blocks[2] == payload(2) and store.match([2]) == [0]
        assert store.stats()["store"].up
    finally:
        store.close()


def test_a_block_still_in_the_write_queue_is_found_and_loaded_from_it(tmp_path):
    class Blocking(FlakyTier):
        def __init__(self):
            super().__init__()
            self.down = False
            import threading
            self.gate = threading.Event()

        def put(self, h, pieces):
            self.gate.wait(10)
            return super().put(h, pieces)

    slow = Blocking()
    store = TieredStore([slow])
    try:
        store.write_down(7, payload(7))
        assert store.match([7]) == [PENDING]
        dest = [memoryview(bytearray(BLOCK))]
        assert store.load_into(7, dest) == "queue" and bytes(dest[0]) == payload(7)
        assert store.write_down(7, payload(7)) is False  # already queued
        slow.gate.set()
        assert store.flush(10) and slow.blocks[7] == payload(7)
    finally:
        slow.gate.set()
        store.close()


def test_a_down_tier_is_reported_and_skipped_until_its_retry(tmp_path):
    flaky = FlakyTier()
    store = TieredStore([flaky], retry_s=3600)
    try:
        dest = [memoryview(bytearray(BLOCK))]
        assert store.load_into(1, dest) is None  # the failure marks it down
        assert not store.stats()["store"].up
        flaky.down = False
        flaky.blocks[1] = payload(1)
        assert store.match([1]) == []  # skipped during the outage window
    finally:
        store.close()


def test_match_takes_each_block_from_the_fastest_tier_holding_it(tmp_path):
    host = FileTier("host", tmp_path / "host", NS, 100 * BLOCK)
    disk = FileTier("disk", tmp_path / "disk", NS, 100 * BLOCK)
    store = TieredStore([host, disk])
    try:
        for h in (1, 2, 3):
            disk.put(h, [payload(h)])
        host.put(2, [payload(2)])
        assert store.match([1, 2, 3, 4, 5]) == [1, 0, 1]  # block 4: nowhere, the prefix ends
        assert store.stats()["host"].queries == 5 and store.stats()["disk"].queries == 4
        assert store.stored_everywhere(2) and not store.stored_everywhere(1)
    finally:
        store.close()
