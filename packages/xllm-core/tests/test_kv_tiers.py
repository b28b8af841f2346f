"""KV tiers below the engine's memory (xllm.core.kv.lower_tiers) on the tiny model: prefixes evicted
from T0 come back from the host (T1) or disk (T2) tier with the outputs of a full recompute, after
an engine restart too; a corrupt block file is recomputed; a tier that goes down is left out while
requests are served; a request aborted mid-load gives its pages back."""

from __future__ import annotations

import os
import random
import threading

import pytest

from xllm.core.sequence import SeqStatus
from xllm.testing.engine import generate, make_engine, make_request
from xllm.testing.reference import recompute_greedy
from xllm.testing.tiny import TinyLM

PROMPT_LEN = 140  # two full 64-token xTensor blocks of the tiny model (fp32), nine 16-token paged ones
NEW = 12


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return TinyLM()


@pytest.fixture(scope="module")
def prompts(model) -> dict[str, list[int]]:
    rng = random.Random(5)
    return {k: [rng.randrange(3, model.vocab_size) for _ in range(PROMPT_LEN)] for k in "ABC"}


@pytest.fixture(scope="module")
def expected(model, prompts) -> dict[str, list[int]]:
    return {k: recompute_greedy(model, p, NEW)[0] for k, p in prompts.items()}


def tiers_engine(model, tmp_path, backend="xtensor", host=True, disk=True, **kw):
    """An engine whose T0 holds about one request (so the next evicts the last one's blocks)."""
    probe = make_engine(model, kv_backend=backend)
    bs = probe.layout.block_size
    probe.close()
    per_block = model.kv_cache_spec().bytes_per_token(probe.layout.dtype) * bs
    blocks = -(-(PROMPT_LEN + NEW) // bs) + 1
    kw.setdefault("kv_cache_memory_gib", blocks * per_block / 2**30)
    return make_engine(model, kv_backend=backend, kv_model_identity="tiny-lm",
                       kv_host_memory_gib=0.01 if host else None, kv_host_dir=str(tmp_path / "host"),
                       kv_disk_dir=str(tmp_path / "disk") if disk else None, **kw)


def ask(engine, rid: str, prompt: list[int], **sampling) -> list[int]:
    sampling.setdefault("max_tokens", NEW)
    sampling.setdefault("ignore_eos", True)
    return generate(engine, [make_request(rid, prompt, **sampling)]).tokens[rid]


def evict_a(engine, prompts, expected) -> None:
    """Run A, then B and C (which take A's pages); wait until A's blocks are written down."""
    for k in "ABC":
        assert ask(engine, k, prompts[k]) == expected[k]
    assert engine.kv.lower.store.flush(30)
    assert engine.kv.pool.lookup(_hashes(engine, prompts["A"])[0]) is None  # A is no longer in T0


def _hashes(engine, prompt):
    from xllm.kvstore import block_hashes
    return block_hashes(prompt, engine.layout.block_size)


@pytest.mark.parametrize("tier,backend,overlapped", [("host", "xtensor", False), ("disk", "paged", False),
                                                     ("host", "paged", True)])
def test_a_prefix_evicted_from_t0_comes_back_from_a_lower_tier(model, prompts, expected, tmp_path, tier, backend,
                                                               overlapped):
    eng = tiers_engine(model, tmp_path, backend, host=tier == "host", disk=tier == "disk",
                       async_scheduling=overlapped)
    try:
        evict_a(eng, prompts, expected)
        before = eng.kv.prefix_stats
        assert ask(eng, "A-again", prompts["A"]) == expected["A"]
        full = (PROMPT_LEN - 1) // eng.layout.block_size
        stats = eng.kv.tier_stats()[tier]
        assert stats.hits == full and stats.bytes_read == full * eng.kv.page_store().block_bytes
        assert eng.kv.prefix_stats.hits - before.hits == full * eng.layout.block_size  # served from T0 after the load
        # seeded sampling: the reloaded prefix gives the same draws as a fresh engine's full prefill
        seeded = dict(temperature=0.8, top_p=0.9, seed=11)
        fresh = make_engine(model, kv_backend=backend)
        assert ask(eng, "A-seeded", prompts["A"], **seeded) == ask(fresh, "A-seeded", prompts["A"], **seeded)
        fresh.close()
        assert eng.kv.num_free_blocks == eng.layout.num_blocks  # loads gave back every page
    finally:
        eng.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_lower_tier_survives_an_engine_restart(model, prompts, expected, tmp_path, tier):
    first = tiers_engine(model, tmp_path)
    evict_a(first, prompts, expected)
    first.close()
    again = tiers_engine(model, tmp_path, host=tier == "host", disk=tier == "disk")  # new engine, same directory
    try:
        assert ask(again, "A-after-restart", prompts["A"]) == expected["A"]
        assert again.kv.tier_stats()[tier].hits == (PROMPT_LEN - 1) // again.layout.block_size
        if tier == "host":
            return
        # another model's engine on the same directory sees none of these blocks
        other = make_engine(model, kv_model_identity="another-model", kv_disk_dir=str(tmp_path / "disk"),
                            kv_cache_memory_gib=again.config.kv_cache_memory_gib)
        assert ask(other, "A-other-model", prompts["A"]) == expected["A"]
        assert other.kv.tier_stats()["disk"].hits == 0
        other.close()
    finally:
        again.close()


def test_an_instance_publishes_its_lower_tier_blocks_and_load_speed_for_tier_aware_routing(model, prompts, expected,
                                                                                            tmp_path):
    """What the engine publishes (events as the engine server records them; the load report) lets the
    gateway's index and policy see that a restarted instance can load A's prefix from its host tier,
    and how fast: the routing decision then follows the predicted TTFT."""
    from xllm.kvstore import GlobalKVIndex, KVEventLog
    from xllm.sched import InstanceSnapshot, KVCacheAwarePolicy, RouteRequest

    first = tiers_engine(model, tmp_path, disk=False)
    evict_a(first, prompts, expected)
    written = {h for tier, stored, h in first.kv.drain_tier_events() if tier == "host" and stored}
    first.close()
    hashes = _hashes(first, prompts["A"])
    assert set(hashes) <= written  # every full block of A went down to the host tier
    again = tiers_engine(model, tmp_path, disk=False)  # a new process: the tier's listing comes first
    try:
        log = KVEventLog("w", again.layout.block_size)  # as the engine server records them
        log.record_tiers(again.kv.drain_tier_events())
        index = GlobalKVIndex()
        index.apply("w", log.snapshot())
        assert index.match_tiers(hashes)["w"].lower == (("host", len(hashes)),)
        assert dict(again.load_report().tier_load_tokens_per_s) == {}  # nothing loaded yet: speed unknown
        assert ask(again, "A-after-restart", prompts["A"]) == expected["A"]
        speed = dict(again.load_report().tier_load_tokens_per_s)["host"]
        assert speed > 0
        bs = again.layout.block_size
        w = InstanceSnapshot("w", prefill_tokens_per_s=speed / 4, lower_matched=(("host", len(hashes) * bs),),
                             tier_load_tokens_per_s=(("host", speed),))
        shallow = InstanceSnapshot("s", prefill_tokens_per_s=speed / 4, matched_tokens=bs)
        assert KVCacheAwarePolicy().route(RouteRequest(PROMPT_LEN), [w, shallow]).instance_id == "w"
        slow = InstanceSnapshot("w", prefill_tokens_per_s=speed * 4, lower_matched=w.lower_matched,
                                tier_load_tokens_per_s=w.tier_load_tokens_per_s)
        fast_shallow = InstanceSnapshot("s", prefill_tokens_per_s=speed * 4, matched_tokens=bs)
        assert KVCacheAwarePolicy().route(RouteRequest(PROMPT_LEN), [slow, fast_shallow]).instance_id == "s"
    finally:
        again.close()


def test_a_corrupt_block_file_is_detected_and_recomputed(model, prompts, expected, tmp_path):
    eng = tiers_engine(model, tmp_path, host=False)
    try:
        evict_a(eng, prompts, expected)
        disk = eng.kv.lower.store.tiers[0]
        second = _hashes(eng, prompts["A"])[1]
        with open(disk.path(second), "r+b") as f:  # flip one byte of the second block's payload
            f.seek(-100, os.SEEK_END)
            byte = f.read(1)
            f.seek(-100, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x40]))
        assert ask(eng, "A-corrupt", prompts["A"]) == expected["A"]
        stats = eng.kv.tier_stats()["disk"]
        assert (stats.hits, stats.corrupt) == (1, 1)  # the first block loaded, the second recomputed
        assert not disk.contains(second) or eng.kv.lower.store.flush(30)
    finally:
        eng.close()


def test_a_tier_that_goes_down_is_left_out_and_requests_are_served(model, prompts, expected, tmp_path):
    eng = tiers_engine(model, tmp_path, host=False)
    try:
        disk = eng.kv.lower.store.tiers[0]
        os.rename(disk.directory, disk.directory + ".gone")  # the disk vanishes ...
        with open(disk.directory, "w") as f:                # ... and its path is no directory any more
            f.write("not a directory")
        evict_a(eng, prompts, expected)
        assert ask(eng, "A-again", prompts["A"]) == expected["A"]  # recomputed: nothing to load
        stats = eng.kv.tier_stats()["disk"]
        assert not stats.up and stats.errors >= 1 and stats.hits == 0
    finally:
        eng.close()


def test_an_aborted_loading_request_gives_its_pages_back(model, prompts, expected, tmp_path):
    eng = tiers_engine(model, tmp_path, host=False)
    try:
        evict_a(eng, prompts, expected)
        gate = threading.Event()
        eng.kv.lower._loader.submit(gate.wait, 30)  # the loader is busy: the next load waits behind it
        eng.add_request(make_request("A-abort", prompts["A"], max_tokens=NEW))
        eng.scheduler.schedule()  # starts the load: the request is LOADING, pages taken for its blocks
        seq = eng.requests["A-abort"].seq
        assert seq.status is SeqStatus.LOADING and eng.kv.num_free_blocks < eng.layout.num_blocks
        eng.abort("A-abort")
        gate.set()
        while eng.has_work():  # the load lands and its pages go back
            eng.step()
        assert eng.kv.num_free_blocks == eng.layout.num_blocks
        assert ask(eng, "A-after", prompts["A"]) == expected["A"]  # the loaded blocks entered the prefix cache
    finally:
        eng.close()


def test_loads_held_by_waiting_requests_never_block_the_head_of_the_queue(model, prompts, expected, tmp_path):
    """Two requests whose prefixes come up from the host tier at once: the head's shares two blocks
    with a stored prompt, the next one's all of them, so the loads take pages for both and the head's
    remaining prompt no longer fits beside the other's loaded blocks. With nothing running no step
    frees a page: the loads the other waiting requests hold are given back (their blocks stay in
    T0's prefix cache) and the head is admitted. Both answers equal a full recompute (seen live:
    requests stalled until the gateway's 300 s idle timeout)."""
    eng = tiers_engine(model, tmp_path, backend="paged", disk=False)
    try:
        evict_a(eng, prompts, expected)
        assert eng.kv.pool.lookup(_hashes(eng, prompts["B"])[0]) is None  # B went down too (C holds T0)
        rng = random.Random(9)
        head = prompts["A"][:2 * eng.layout.block_size]
        head = head + [rng.randrange(3, model.vocab_size) for _ in range(PROMPT_LEN - len(head))]
        want = {"head": recompute_greedy(model, head, NEW)[0], "B": expected["B"]}
        got = generate(eng, [make_request("head", head, max_tokens=NEW, ignore_eos=True),
                             make_request("B", prompts["B"], max_tokens=NEW, ignore_eos=True)])
        assert {k: got.tokens[k] for k in want} == want
        assert eng.kv.lower.stats()["host"].hits > 0  # prefixes did come up from the host tier
    finally:
        eng.close()


# ---- T3: the Mooncake store (a master on loopback, started here) -------------------------------------
@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    from xllm.testing.processes import start_mooncake_master

    store = start_mooncake_master(tmp_path_factory.mktemp("mooncake"))
    yield store
    store.stop()


def store_engine(model, mooncake, **kw):
    master, metadata = mooncake.address, mooncake.metadata_url
    probe = make_engine(model)
    bs = probe.layout.block_size
    probe.close()
    per_block = model.kv_cache_spec().bytes_per_token(probe.layout.dtype) * bs
    blocks = -(-(PROMPT_LEN + NEW) // bs) + 1
    return make_engine(model, kv_model_identity="tiny-lm", kv_store=f"mooncake://{master}", kv_store_metadata=metadata,
                       kv_store_segment_gib=0.05, kv_cache_memory_gib=blocks * per_block / 2**30, **kw)


def test_the_mooncake_store_serves_another_instance_and_an_outage_is_survived(model, prompts, expected, mooncake):
    # (Mooncake keeps objects in the memory its clients lend the pool: the writing instance stays up)
    first = store_engine(model, mooncake)
    other = store_engine(model, mooncake)  # another instance of the cluster (its own store client)
    try:
        evict_a(first, prompts, expected)
        assert first.kv.tier_stats()["store"].blocks_written >= 2
        assert ask(other, "A-elsewhere", prompts["A"]) == expected["A"]
        assert other.kv.tier_stats()["store"].hits == (PROMPT_LEN - 1) // other.layout.block_size
        # a damaged object in the store (same length, one byte changed) is caught by its checksum
        other.kv.pool.discard(other.kv.pool.lookup(_hashes(other, prompts["A"])[0]))  # out of its T0 again
        tier, second = first.kv.lower.store.tiers[0], _hashes(first, prompts["A"])[1]
        value = bytearray(tier.raw_get(tier.key(second)))
        value[-1] ^= 0x01
        assert tier.evict(second) and tier.raw_put(tier.key(second), bytes(value)) == 0
        assert ask(other, "A-damaged", prompts["A"]) == expected["A"]
        stats = other.kv.tier_stats()["store"]
        assert (stats.hits, stats.corrupt) == ((PROMPT_LEN - 1) // other.layout.block_size + 1, 1)
        first.close()
        mooncake.master.kill()  # the store goes down: B's lookup fails, the tier is left out
        mooncake.master.wait()
        assert ask(other, "B-outage", prompts["B"]) == expected["B"]
        assert ask(other, "C-outage", prompts["C"]) == expected["C"]  # evicts B: not written (tier down)
        assert ask(other, "B-again", prompts["B"]) == expected["B"]  # recomputed
        stats = other.kv.tier_stats()["store"]
        assert not stats.up and stats.errors >= 1 and stats.blocks_written == 0
    finally:
        other.close()
        first.close()  # (a second close does nothing)
