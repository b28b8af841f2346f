"""Prefill/decode hand-offs between instances of different tensor-parallel sizes: a TP=2 prefill instance hands
its KV to a TP=1 decode instance and the reverse, over ``grpc`` (layers streamed) and ``mooncake`` (pages after
the first token: no cluster store, which TP refuses), the ranks' collectives over shared memory and gloo;
``fd`` (one memfd's pages) refuses a TP sender. The tiny random Llama of ``test_tensor_parallel_engine`` (9
query / 3 KV heads: ranks hold 2+1 KV heads) on xTensor and paged KV, engine servers in this process (the TP=2
one's rank 1 a spawned worker).

Oracle: one TP=1 engine serving the whole request (greedy and seeded sampling, same tokens and finish
reason); the hand-off must be installed, not recomputed. A second and third request share the first's
prefix: the decode side's prefix cache matches it after the hand-off (a smaller transfer). Unit: the head
interleave / split (:mod:`xllm.core.executor.kv_pages`) with uneven (2+1) and replicated heads.
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np
import pytest
import torch

from xllm.core.config import EngineConfig
from xllm.core.executor.kv_pages import KVHeads, gather_heads, split_heads
from xllm.engine.config import engine_config
from xllm.engine.handoff.base import HandoffOptions
from xllm.engine.loader import LoadedEngine, load_engine
from xllm.engine_api import flags
from xllm.engine_api.errors import ConfigError
from xllm.models import resolve_model
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import Collected, MigrationListener, make_request, moved_decode_request
from xllm.testing.models import save_llama_9q3kv
from xllm.testing.processes import until
from xllm.testing.served import DECODE, HANDED_OFF, PREFILL, ServedEngine, pd_generate, pd_request

transformers = pytest.importorskip("transformers")

SYSTEM = list(range(1000, 1140))  # longer than one 128-token block: the decode side's prefix cache matches it
REQUESTS = [  # (id, prompt, sampling): the second and third share the first's prefix
    ("greedy", [*SYSTEM, 2001, 2002, 2003], dict(max_tokens=16, ignore_eos=True)),
    ("seeded", [*SYSTEM, 2101, 2102], dict(max_tokens=16, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)),
    ("stops", [*SYSTEM, 2201], dict(max_tokens=6)),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_llama_9q3kv(tmp_path_factory.mktemp("tp_pd") / "llama_9q3kv", resolve_model(None, progress=False))


def load(model_dir, tp: int, name: str, backend: str = "xtensor", comm: str = "auto") -> LoadedEngine:
    # 1024 tokens of 3 KV heads of 16, fp32, 2 layers (768 B a token); a small token budget: chunked prefills
    cfg = EngineConfig(dtype=torch.float32, quantization="none", kv_cache_backend=backend, max_num_seqs=4,
                       max_num_batched_tokens=64, kv_cache_memory_gib=8 * 128 * 768 / 2**30, max_model_len=512,
                       num_threads=1, tensor_parallel_size=tp, tp_comm=comm)
    return load_engine(str(model_dir), "tiny", cfg, name, progress=False)


def close(loaded: LoadedEngine) -> None:
    loaded.engine.close()
    loaded.compute.shutdown()


@pytest.fixture(scope="module")
def oracle(model_dir) -> Collected:
    """Each request served whole by one TP=1 engine."""
    one = load(model_dir, 1, "oracle")
    got = Collected()

    def drive():
        for rid, prompt, sampling in REQUESTS:
            got.add(one.engine.add_request(make_request(rid, prompt, **sampling)))
            while one.engine.has_work():
                got.add(one.engine.step())

    try:
        one.compute.call(drive)
    finally:
        close(one)
    return got


@pytest.mark.parametrize(("transport", "backend", "comm"),
                         [("grpc", "xtensor", "shm"), ("mooncake", "xtensor", "shm"), ("grpc", "paged", "shm"),
                          ("grpc", "xtensor", "gloo")], ids=["grpc", "mooncake", "grpc-paged", "grpc-gloo"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_handoff_between_tensor_parallel_sizes_equals_one_engine(model_dir, oracle, transport, backend, comm,
                                                                 prefill_tp, decode_tp):
    p_loaded, d_loaded = load(model_dir, prefill_tp, "p", backend, comm), None
    try:
        d_loaded = load(model_dir, decode_tp, "d", backend, comm)

        async def main():
            options = HandoffOptions(transport=transport, reservation_timeout=30.0)
            prefill = await ServedEngine(p_loaded.engine, handoff=options).start()
            decode = await ServedEngine(d_loaded.engine, handoff=options).start()
            try:
                runs = [await pd_generate(prefill, decode, rid, prompt, **sampling)
                        for rid, prompt, sampling in REQUESTS]
                layouts = prefill.aeng.kv_layout.fingerprint, decode.aeng.kv_layout.fingerprint
                block_size = decode.aeng.kv_layout.block_size
                return runs, layouts, block_size, prefill.server.counters(), decode.server.counters()
            finally:
                await prefill.stop()
                await decode.stop()

        runs, layouts, bs, p_counts, d_counts = asyncio.run(asyncio.wait_for(main(), 240))
    finally:
        close(p_loaded)
        if d_loaded is not None:
            close(d_loaded)
    assert layouts[0] == layouts[1] and "3H16K16V" in layouts[0]  # both speak the whole model's 3 KV heads
    for (rid, prompt, _), (got, reservation, stats) in zip(REQUESTS, runs, strict=True):
        assert stats is not None and not stats.recomputed, (rid, stats)
        assert got.tokens[rid] == oracle.tokens[rid], rid
        assert got.text[rid] == oracle.text[rid], rid
        assert got.final[rid].finish_reason == oracle.final[rid].finish_reason, rid
        # the first request fills the decode side's prefix cache; the later ones match its first block there
        matched = 0 if rid == "greedy" else len(SYSTEM) // bs * bs
        assert rid == "greedy" or matched > 0
        assert reservation.matched_tokens == matched, rid
        assert stats.transferred_tokens == len(prompt) - matched > 0, rid
        assert stats.transfer_bytes > 0
    assert (p_counts.kv_handoffs_sent, d_counts.kv_handoffs_installed, d_counts.kv_handoff_failures) == (3, 3, 0)


def _canonical(rows: int, total: int, head_bytes: int) -> np.ndarray:
    # every byte names its row and head: a head taken from the wrong place shows
    grid = np.arange(rows * total, dtype=np.int64).reshape(rows, total, 1) * 7 + np.arange(head_bytes)
    return (grid % 251).astype(np.uint8).reshape(-1)


@pytest.mark.parametrize("spans", [((0, 2), (2, 3)), ((0, 1), (1, 3)), ((0, 1), (0, 1), (1, 2), (1, 2))],
                         ids=["2+1", "1+2", "replicated"])
def test_the_head_interleave_round_trips(spans):
    heads, rows, hb = KVHeads(spans), 5, 8
    canonical = _canonical(rows, heads.total, hb)
    parts = [split_heads(canonical, heads, r, rows, hb) for r in range(len(spans))]
    for r, (s, e) in enumerate(spans):
        want = canonical.reshape(rows, heads.total, hb)[:, s:e].reshape(-1)
        assert np.array_equal(parts[r], want)
    widest = max(len(p) for p in parts)  # as all_gather carries them: padded to the largest rank's
    padded = [np.concatenate([p, np.full(widest - len(p), 255, np.uint8)]) for p in parts]
    assert np.array_equal(gather_heads(padded, heads, rows, hb), canonical)
    # the ranks' parts in another order, or one rank's heads read as another's, are not the KV
    assert not np.array_equal(gather_heads(list(reversed(padded)), heads, rows, hb), canonical)
    shifted = KVHeads(tuple((s, e) for s, e in reversed(spans)))
    if shifted != heads:
        assert not np.array_equal(gather_heads(padded, shifted, rows, hb), canonical)


def test_head_spans_must_cover_every_head():
    with pytest.raises(ValueError, match="do not cover"):
        KVHeads(((0, 1), (2, 3)))


def test_roles_are_accepted_with_tensor_parallelism_but_not_quantized_kv():
    parser = argparse.ArgumentParser()
    flags.add_engine_process_arguments(parser)
    cfg = engine_config(parser.parse_args(["--tensor-parallel-size", "2", "--role", "prefill"]))
    assert cfg.tensor_parallel_size == 2
    args = parser.parse_args(["--tensor-parallel-size", "2", "--role", "decode", "--kv-cache-dtype", "int8"])
    with pytest.raises(ConfigError, match="--kv-cache-dtype int8"):
        engine_config(args)


def test_the_fd_transport_refuses_a_tensor_parallel_sender(model_dir, caplog):
    """A TP=2 instance's KV is in no one memfd: its hand-off over ``fd`` fails at once, naming why, its KV is
    freed, and the decode side's reservation expires (the request fails there: the gateway resumes it)."""
    p_loaded, d_loaded = load(model_dir, 2, "p"), None
    try:
        d_loaded = load(model_dir, 1, "d")

        async def main():
            prefill = await ServedEngine(p_loaded.engine, handoff=HandoffOptions(transport="fd")).start()
            decode = await ServedEngine(d_loaded.engine, handoff=HandoffOptions(transport="fd",
                                                                                reservation_timeout=0.5)).start()
            free = p_loaded.engine.kv.num_free_blocks
            try:
                d_stream = aiter(await decode.client.submit(pd_request("r", DECODE, REQUESTS[0][1], **REQUESTS[0][2])))
                target = (await anext(d_stream)).kv_reservation
                chunks = [c async for c in await prefill.client.submit(
                    pd_request("r", PREFILL, REQUESTS[0][1], target, **REQUESTS[0][2]))]
                assert chunks[-1].finish_reason == HANDED_OFF
                rest = [c async for c in d_stream]
                assert rest[-1].finish_reason == engine_pb2.FINISH_REASON_ERROR
                await until(lambda: p_loaded.engine.kv.num_free_blocks == free, 10, "the prefill side's KV freed")
                return prefill.server.counters(), decode.server.counters()
            finally:
                await prefill.stop()
                await decode.stop()

        p_counts, d_counts = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        close(p_loaded)
        if d_loaded is not None:
            close(d_loaded)
    assert p_counts.kv_handoff_failures == 1 and d_counts.kv_reservations_expired == 1
    assert "--tensor-parallel-size 1" in caplog.text


def _copy(src, dst, src_pages, dst_pages, blocks: range) -> None:
    s, d = src.transfer_store(), dst.transfer_store()
    for j in blocks:
        d.write_block(dst_pages[j], s.read_block(src_pages[j]))


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_a_request_migrated_between_tensor_parallel_sizes_equals_one_engine(model_dir, oracle, src_tp, dst_tp):
    """A running request's KV moves in two stages (full blocks while it decodes, then the rest) through the
    engines' transfer stores, as :mod:`xllm.engine.handoff.migration` moves it; the destination continues it."""
    rid, prompt, sampling = REQUESTS[1]  # seeded
    src_l, dst_l = load(model_dir, src_tp, "src"), None
    try:
        dst_l = load(model_dir, dst_tp, "dst")
        src, dst = src_l.engine, dst_l.engine
        src.attach_disagg(MigrationListener())
        dst.attach_disagg(MigrationListener())
        req = make_request(rid, prompt, **sampling)
        client = Collected()
        client.add(src.add_request(req))
        while len(client.tokens.get(rid, [])) < 5:
            client.add(src.step())
        cont = moved_decode_request(req, client)
        assert dst.add_request(cont) == []
        dst.step()  # reserves
        reservation = dst.disagg.reserved[rid]
        reserved, bs = reservation.num_tokens, src.layout.block_size
        snap = src.move_snapshot(rid)
        staged = range(0, min(snap.num_computed_tokens, reserved) // bs)
        _copy(src, dst, snap.pages, reservation.pages, staged)  # while the request keeps running
        client.add(src.step())
        assert src.pause_for_move(rid)
        while rid not in src.disagg.ready:
            client.add(src.step())
        ready = src.disagg.ready[rid]
        covered = min(ready.num_computed_tokens, reserved)
        _copy(src, dst, ready.pages, reservation.pages, range(staged.stop, -(-covered // bs)))
        commit = engine_pb2.KVCommit(transfer_id=rid, num_tokens=covered, migration=engine_pb2.MIGRATION_STAGE_FINAL,
                                     appended_tokens=ready.token_ids[reserved:], sent_chars=ready.sent_chars)
        client.add(dst.install_kv(commit, received=True))
        assert [c.finish_reason for c in src.release_kv(rid)] == [HANDED_OFF]
        while dst.has_work():
            client.add(dst.step())
    finally:
        close(src_l)
        if dst_l is not None:
            close(dst_l)
    assert len(staged) >= 1
    assert client.tokens[rid] == oracle.tokens[rid] and client.text[rid] == oracle.text[rid]
    assert client.final[rid].finish_reason == oracle.final[rid].finish_reason
