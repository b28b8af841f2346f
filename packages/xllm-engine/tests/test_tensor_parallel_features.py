"""Engine features with tensor parallelism (``--tensor-parallel-size 2``: rank 0 here, rank 1 a spawned worker,
the tiny random Llama split 6+3 query / 2+1 KV heads), each against the one-process engine (TP=1) of the same
weights and flags, greedy and seeded sampling token for token.

- KV tiers: a prefix evicted from T0 to the disk tier comes back from it (its counters show every full block
  read) with the outputs of TP=1; the tier's blocks hold every KV head (the canonical layout), so a TP=1
  engine over the same directory (or sharing a Mooncake store) reads the TP=2 engine's blocks and computes the
  same tokens.
- Beam search: the same hypotheses (tokens, and scores to float noise) as TP=1, with beam rows riding in
  ordinary steps and in forwards of their own, prompt KV in slots (xTensor) and pages (paged).
- ``--speculative self``: the same tokens as TP=1, and the draft itself (the first layers, on every rank with
  a KV memory of its own) proposes TP=1's drafts.

Synchronous and asynchronous scheduling (where the engine thread's KV page copies and drafts meet a forward
in flight on the ranks).
"""

from __future__ import annotations

import random

import pytest
import torch

from xllm.core.config import EngineConfig
from xllm.core.sequence import Sequence
from xllm.engine.loader import LoadedEngine, load_engine
from xllm.kvstore import block_hashes
from xllm.models import resolve_model
from xllm.testing.engine import Collected, make_request
from xllm.testing.models import save_llama_9q3kv

PROMPT_LEN = 300  # two full 128-token xTensor blocks
NEW = 12
SEEDED = dict(temperature=0.8, top_p=0.9, seed=11)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_llama_9q3kv(tmp_path_factory.mktemp("tpf") / "llama_9q3kv", resolve_model(None, progress=False))


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = random.Random(7)
    return {k: [rng.randrange(10, 4000) for _ in range(PROMPT_LEN)] for k in "ABC"}


def load(model_dir, tp: int, blocks: int = 4, kv_cache_backend: str = "xtensor", **extra) -> LoadedEngine:
    # ``blocks`` 128-token blocks' KV at TP=1 (3 KV heads of 16, fp32, 2 layers: 768 B per token; rank 0 of TP=2
    # holds 2 of them in the same memory: more blocks)
    memory = blocks * 128 * 768 / 2**30
    cfg = EngineConfig(dtype=torch.float32, quantization="none", kv_cache_backend=kv_cache_backend, max_num_seqs=4,
                       max_num_batched_tokens=128, kv_cache_memory_gib=memory, max_model_len=512,
                       num_threads=1, tensor_parallel_size=tp, **{"speculative": None, **extra})
    return load_engine(str(model_dir), "tiny", cfg, f"tp{tp}", progress=False)


def close(loaded: LoadedEngine) -> None:
    try:
        loaded.engine.close()
    finally:
        loaded.compute.shutdown()


def ask(loaded: LoadedEngine, rid: str, prompt: list[int], **sampling) -> list[int]:
    """One request run to its end on the engine's compute thread; its tokens."""
    sampling.setdefault("max_tokens", NEW)
    sampling.setdefault("ignore_eos", True)
    engine = loaded.engine

    def drive() -> Collected:
        got = Collected()
        got.add(engine.add_request(make_request(rid, prompt, **sampling)))
        while engine.has_work():
            got.add(engine.step())
        return got

    return drive_on(loaded, drive).tokens[rid]


def drive_on(loaded: LoadedEngine, drive):
    """Synchronous: the engine steps on its compute thread (as AsyncEngine runs it); overlapped (async
    scheduling), the forwards go to that thread and the loop runs on this one."""
    return drive() if loaded.engine.config.async_scheduling else loaded.compute.call(drive)


def tier_hits(loaded: LoadedEngine) -> int:
    return loaded.engine.kv.tier_stats()["disk"].hits


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
def test_a_prefix_evicted_to_a_tier_comes_back_at_two_ranks(model_dir, prompts, tmp_path, overlapped):
    one = load(model_dir, 1, blocks=16)  # the oracle: no tiers, room for everything
    try:
        want = {k: ask(one, k, p) for k, p in prompts.items()}
        want_seeded = ask(one, "A-seeded", prompts["A"], **SEEDED)
    finally:
        close(one)
    disk = str(tmp_path / "disk")
    # T0 holds about one request's blocks (async scheduling: the engine thread copies evicted blocks out while the
    # next forward may hold the ranks)
    two = load(model_dir, 2, blocks=3, kv_disk_dir=disk, async_scheduling=overlapped)
    try:
        engine = two.engine
        fingerprint = engine.kv.lower.pages.layout
        assert fingerprint == engine.transfer_layout.fingerprint != engine.layout.fingerprint  # every head's
        for k in "ABC":
            assert ask(two, k, prompts[k]) == want[k], k
        assert engine.kv.lower.store.flush(30)
        assert tier_hits(two) == 0
        full = (PROMPT_LEN - 1) // engine.layout.block_size
        assert full >= 2
        hashes = block_hashes(prompts["A"], engine.layout.block_size)[:full]
        assert all(engine.kv.pool.lookup(h) is None for h in hashes)  # A's blocks left T0
        assert ask(two, "A-again", prompts["A"]) == want["A"]
        stats = engine.kv.tier_stats()["disk"]
        assert stats.hits == full, "the prefix did not come back from the tier"
        assert stats.bytes_read == full * engine.transfer_store().block_bytes
        assert engine.kv.lower.counters.blocks_loaded == full
        assert ask(two, "A-seeded", prompts["A"], **SEEDED) == want_seeded
        assert engine.kv.num_free_blocks == engine.layout.num_blocks  # loads gave back every page
    finally:
        close(two)
    # the blocks hold every KV head: a one-rank engine of the same layout reads them
    one = load(model_dir, 1, blocks=3, kv_disk_dir=disk)
    try:
        assert one.engine.layout.fingerprint == fingerprint
        assert ask(one, "A-at-one-rank", prompts["A"]) == want["A"]
        assert tier_hits(one) == full
    finally:
        close(one)


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    from xllm.testing.processes import start_mooncake_master

    store = start_mooncake_master(tmp_path_factory.mktemp("mooncake"))
    yield store
    store.stop()


def test_a_block_a_two_rank_instance_put_in_the_mooncake_store_serves_a_one_rank_one(model_dir, prompts, mooncake):
    store = dict(kv_store=f"mooncake://{mooncake.address}", kv_store_metadata=mooncake.metadata_url,
                 kv_store_segment_gib=0.05)
    # (Mooncake keeps objects in the memory its clients lend the pool: the writing instance stays up)
    two = load(model_dir, 2, blocks=3, **store)
    one = None
    try:
        want = {k: ask(two, k, p) for k, p in prompts.items()}  # C evicts A's blocks: written to the store
        assert two.engine.kv.lower.store.flush(30)
        full = (PROMPT_LEN - 1) // two.engine.layout.block_size
        assert two.engine.kv.tier_stats()["store"].blocks_written >= full
        one = load(model_dir, 1, blocks=3, **store)
        assert ask(one, "A-elsewhere", prompts["A"]) == want["A"]
        assert one.engine.kv.tier_stats()["store"].hits == full
    finally:
        if one is not None:
            close(one)
        close(two)


def beam_workload(prompts) -> list:
    """Beam requests beside ordinary ones (their rows ride in the ordinary steps' forwards: beside a long prompt's
    chunks, after them in a forward of their own), then alone (forwards of beam rows only); a prompt longer than a
    block (its KV in several pages)."""
    return [make_request("beams-B", prompts["B"][:40], max_tokens=9, beam_width=2, ignore_eos=True),
            make_request("beams-A", prompts["A"][:150], max_tokens=6, beam_width=3, ignore_eos=True),
            make_request("greedy", prompts["C"][:250], max_tokens=5, ignore_eos=True),
            make_request("seeded", prompts["C"][30:70], max_tokens=5, ignore_eos=True, **SEEDED)]


def run_all(loaded: LoadedEngine, reqs) -> Collected:
    engine = loaded.engine

    def drive() -> Collected:
        got = Collected()
        for r in reqs:
            got.add(engine.add_request(r))
        while engine.has_work():
            got.add(engine.step())
        return got

    return drive_on(loaded, drive)


@pytest.mark.parametrize(("backend", "overlapped"), [("xtensor", False), ("paged", False), ("xtensor", True)],
                         ids=["xtensor", "paged", "xtensor-async"])
def test_beam_search_at_two_ranks_finds_what_one_rank_does(model_dir, prompts, backend, overlapped):
    reqs = beam_workload(prompts)
    one = load(model_dir, 1, blocks=16, kv_cache_backend=backend, async_scheduling=overlapped)
    try:
        want = run_all(one, reqs)
    finally:
        close(one)
    two = load(model_dir, 2, blocks=16, kv_cache_backend=backend, async_scheduling=overlapped)
    try:
        got = run_all(two, reqs)
        runner = two.engine.runner
        assert runner.mode_steps["beams"] > 0, "no beam rows rode in a step"
        assert runner.beam_forwards > 0, "no forward of beam rows alone"
    finally:
        close(two)
    for rid in ("greedy", "seeded"):
        assert got.tokens[rid] == want.tokens[rid], rid
    for rid in ("beams-A", "beams-B"):
        mine, theirs = got.final[rid].beams, want.final[rid].beams
        assert len(mine) == len(theirs) > 1, rid
        assert [list(b.token_ids) for b in mine] == [list(b.token_ids) for b in theirs], rid
        assert [b.score for b in mine] == pytest.approx([b.score for b in theirs], abs=1e-4), rid


def propose(loaded: LoadedEngine, req) -> list[int]:
    """The self proposer's 4 drafts for a new sequence of ``req``'s prompt (its catch-up over the prompt, then
    greedy rounds), on the engine's compute thread."""
    engine = loaded.engine
    seq = Sequence(req.request_id, list(req.prompt_token_ids), engine.validate(req), 0.0)

    def run() -> list[int]:
        proposer = engine.spec.proposer
        try:
            return proposer.propose([(seq, 4)])[0]
        finally:
            proposer.release(seq)

    return loaded.compute.call(run)


def self_workload(prompts) -> list:
    reqs = [make_request(f"greedy{i}", prompts["A"][:50 + 40 * i], max_tokens=16, ignore_eos=True) for i in range(2)]
    reqs += [make_request(f"seeded{i}", prompts["B"][:60 + 30 * i], max_tokens=16, ignore_eos=True,
                          **{**SEEDED, "seed": 11 + i}) for i in range(2)]
    return reqs


# the tiny model has 2 layers: a 2-layer draft is the model itself (its greedy drafts are the greedy tokens: verify
# steps accept them), a 1-layer one (the default) a random guess
@pytest.mark.parametrize(("backend", "overlapped", "layers"), [("xtensor", False, 2), ("paged", True, None)],
                         ids=["xtensor-2-layers", "paged-async-1-layer"])
def test_self_speculation_at_two_ranks_generates_what_one_rank_does(model_dir, prompts, backend, overlapped, layers):
    reqs = self_workload(prompts)
    flags = dict(kv_cache_backend=backend, async_scheduling=overlapped, speculative="self", num_speculative_tokens=2,
                 speculative_self_layers=layers)
    probe = make_request("probe", prompts["C"][:100], max_tokens=8)
    one = load(model_dir, 1, blocks=16, **flags)
    try:
        want = run_all(one, reqs)
        want_drafts = propose(one, probe)
    finally:
        close(one)
    two = load(model_dir, 2, blocks=16, **flags)
    try:
        got = run_all(two, reqs)
        spec = two.engine.spec
        draft_steps = sum(spec.proposer.runner.mode_steps.values())
        counters = spec.counters
        drafts = propose(two, probe)
    finally:
        close(two)
    for r in reqs:
        assert got.tokens[r.request_id] == want.tokens[r.request_id], r.request_id
    assert draft_steps > 0 and counters.num_draft_tokens > 0, "the draft never ran"
    # the drafts themselves are TP=1's (a wrong draft would only cost acceptance, not change the tokens; how many
    # drafts the engine asks for depends on timings)
    assert len(want_drafts) == 4 and drafts == want_drafts
    if layers == 2:
        assert counters.num_accepted_tokens > 0, "no draft accepted"
