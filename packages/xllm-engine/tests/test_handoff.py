"""KV hand-off between two engine servers (tiny model, in one process, over loopback gRPC): the
decode server reserves, the prefill server computes the prompt and the first token and sends the KV
over each transport, the decode server continues. The oracle is one engine serving the whole
request; plus corrupted transfers, unreachable decode sides and expired reservations."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from xllm.engine.handoff.base import HandoffOptions
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import generate, make_engine, make_request
from xllm.testing.processes import until
from xllm.testing.served import DECODE, HANDED_OFF, PREFILL, ServedEngine, corrupt_grpc_pages, pd_generate, pd_request
from xllm.testing.tiny import TinyLM, tiny_tokenizer

MODEL = TinyLM()
PROMPT = tiny_tokenizer().encode_pieces(list("the quick brown fox jumps over the lazy dog, twice over " * 2))
GREEDY = dict(max_tokens=20, ignore_eos=True)
SEEDED = dict(max_tokens=20, temperature=0.8, seed=77, ignore_eos=True)


async def served(name: str, **handoff) -> ServedEngine:
    engine = make_engine(MODEL)
    engine.instance_id = name
    return await ServedEngine(engine, handoff=HandoffOptions(**handoff)).start()


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("transport", ["fd", "grpc"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_handoff_over_each_transport_equals_one_engine(transport, sampling):
    mixed = generate(make_engine(MODEL), [make_request("r", PROMPT, **sampling)])

    async def main():
        prefill, decode = await served("p", transport=transport), await served("d", transport=transport)
        try:
            got, reservation, stats = await pd_generate(prefill, decode, "r", PROMPT, **sampling)
            counters = prefill.server.counters(), decode.server.counters()
            return got, reservation, stats, counters
        finally:
            await prefill.stop()
            await decode.stop()

    got, reservation, stats, (p_counts, d_counts) = run(main())
    assert reservation.transport == transport and reservation.matched_tokens == 0
    assert got.tokens["r"] == mixed.tokens["r"] and got.text["r"] == mixed.text["r"]
    assert got.final["r"].finish_reason == mixed.final["r"].finish_reason
    assert stats is not None and not stats.recomputed and stats.transfer_bytes > 0
    assert stats.transferred_tokens == len(PROMPT)
    # grpc sends each layer as the prefill forward stores it: the pages arrive before the commit
    assert (stats.overlapped_seconds > 0) == (transport == "grpc")
    assert (p_counts.kv_handoffs_sent, d_counts.kv_handoffs_installed, d_counts.kv_handoff_failures) == (1, 1, 0)
    assert d_counts.kv_transfer_bytes == stats.transfer_bytes


def test_a_corrupted_block_makes_the_decode_side_recompute(monkeypatch):
    """Corrupt one range of pages in flight: the CRC catches it and the decode side computes the prompt
    itself; the client still gets exactly the one-engine answer."""
    mixed = generate(make_engine(MODEL), [make_request("r", PROMPT, **SEEDED)])
    corrupt_grpc_pages(monkeypatch, 1)  # one byte of the second range changes on the wire, after its CRC

    async def main():
        prefill, decode = await served("p", transport="grpc"), await served("d", transport="grpc")
        try:
            return (*(await pd_generate(prefill, decode, "r", PROMPT, **SEEDED)), decode.server.counters())
        finally:
            await prefill.stop()
            await decode.stop()

    got, _, stats, counts = run(main())
    assert stats.recomputed and "corrupted" in stats.failure and stats.transfer_bytes == 0
    assert counts.kv_handoff_failures == 1 and counts.kv_handoffs_installed == 0
    assert got.tokens["r"] == mixed.tokens["r"] and got.text["r"] == mixed.text["r"]


def test_an_unreachable_decode_side_releases_the_prefill_kv_and_the_reservation_expires():
    async def main():
        prefill = await served("p", transport="grpc")
        decode = await served("d", transport="grpc", reservation_timeout=0.5)
        free_p, free_d = prefill.engine.kv.num_free_blocks, decode.engine.kv.num_free_blocks
        try:
            d_stream = aiter(await decode.client.submit(pd_request("r", DECODE, PROMPT, **GREEDY)))
            target = (await anext(d_stream)).kv_reservation
            target.address = "127.0.0.1:1"  # nobody listens there
            chunks = [c async for c in await prefill.client.submit(pd_request("r", PREFILL, PROMPT, target, **GREEDY))]
            assert chunks[0].token_ids and chunks[-1].finish_reason == HANDED_OFF
            assert chunks[0].disagg_stats.prefill_seconds > 0
            rest = [c async for c in d_stream]  # the reservation expires: the request fails there
            assert rest[-1].finish_reason == engine_pb2.FINISH_REASON_ERROR and "never arrived" in rest[-1].error
            await until(lambda: prefill.engine.kv.num_free_blocks == free_p, 10, "the prefill side's KV freed")
            return (prefill.server.counters(), decode.server.counters(), prefill.engine.kv.num_free_blocks == free_p,
                    decode.engine.kv.num_free_blocks == free_d)
        finally:
            await prefill.stop()
            await decode.stop()

    p_counts, d_counts, p_freed, d_freed = run(main())
    assert p_counts.kv_handoff_failures == 1 and d_counts.kv_reservations_expired == 1
    assert p_freed and d_freed


def test_cancelling_between_the_phases_frees_both_sides():
    async def main():
        prefill, decode = await served("p", transport="fd"), await served("d", transport="fd")
        free_p, free_d = prefill.engine.kv.num_free_blocks, decode.engine.kv.num_free_blocks
        try:
            d_stream = await decode.client.submit(pd_request("r", DECODE, PROMPT, **GREEDY))
            it = aiter(d_stream)
            target = (await anext(it)).kv_reservation
            assert decode.engine.kv.num_free_blocks < free_d
            with contextlib.suppress(StopAsyncIteration):
                await it.aclose()  # the client went away after the reservation, before any prefill
            await until(lambda: decode.engine.kv.num_free_blocks == free_d and not decode.engine.requests, 10,
                        "the abandoned reservation freed")
            freed_d = decode.engine.kv.num_free_blocks == free_d
            # a prefill for the abandoned reservation finds nothing to fill, and still frees its own KV
            chunks = [c async for c in await prefill.client.submit(pd_request("r", PREFILL, PROMPT, target, **GREEDY))]
            await until(lambda: prefill.engine.kv.num_free_blocks == free_p, 10, "the prefill side's KV freed")
            return freed_d, chunks, prefill.engine.kv.num_free_blocks == free_p
        finally:
            await prefill.stop()
            await decode.stop()

    freed_d, chunks, freed_p = run(main())
    assert freed_d and freed_p and chunks[-1].finish_reason == HANDED_OFF


def test_the_decode_side_prefix_cache_shrinks_the_transfer():
    tok = tiny_tokenizer()
    system = tok.encode_pieces(list("you are a helpful assistant and you answer briefly. " * 3)[:130])

    async def main():
        prefill, decode = await served("p", transport="grpc"), await served("d", transport="grpc")
        try:
            first = await pd_generate(prefill, decode, "a", system + tok.encode_pieces(list("hi")), **GREEDY)
            second = await pd_generate(prefill, decode, "b", system + tok.encode_pieces(list("yo")), **GREEDY)
            return first, second
        finally:
            await prefill.stop()
            await decode.stop()

    (_, r1, s1), (got, r2, s2) = run(main())
    bs = make_engine(MODEL).layout.block_size
    assert r1.matched_tokens == 0 and r2.matched_tokens == len(system) // bs * bs > 0
    assert s2.transferred_tokens == len(system) + 2 - r2.matched_tokens < s1.transferred_tokens
    mixed = generate(make_engine(MODEL), [make_request("b", system + tok.encode_pieces(list("yo")), **GREEDY)])
    assert got.tokens["b"] == mixed.tokens["b"]
