"""Beam search through the cluster path: a gateway dispatcher and engines served over gRPC (in one
process, the tiny model): the hypotheses arrive as the in-process engine gives them, from one mixed
instance and from a prefill/decode pair (the prompt computed on the prefill instance, its KV handed
off, the search run on the decode instance)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from xllm.gateway.disagg import PDStream
from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.metrics import PDMetrics
from xllm.gateway.registry import EmbeddedRegistry
from xllm.gateway.router import Router
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import generate, make_engine
from xllm.testing.served import ServedEngine, ServedEngines


def _beam(rid: str, **sp) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=[5, 6, 7, 8, 9, 10],
                                      sampling=engine_pb2.SamplingParams(beam_width=6, **sp))


def test_beam_requests_over_grpc_equal_the_engine(tmp_path):
    items = np.random.default_rng(2).integers(1, 60, size=(50, 3)).astype(np.int32)
    np.save(tmp_path / "items.npy", items)
    reference = make_engine(item_catalog=str(tmp_path / "items.npy"))
    want_text = generate(reference, [_beam("t", max_tokens=5, ignore_eos=True)]).final["t"].beams
    want_items = generate(reference, [_beam("c", max_tokens=1, item_catalog=True)]).final["c"].beams

    async def run():
        registry = EmbeddedRegistry()
        served = ServedEngine(make_engine(item_catalog=str(tmp_path / "items.npy")), model="tiny")
        await served.start(registry)
        dispatcher = Dispatcher(registry, "tiny", Router(registry, "kv_aware"))
        try:
            got = {}
            for req in (_beam("t", max_tokens=5, ignore_eos=True), _beam("c", max_tokens=1, item_catalog=True)):
                _, streams = await dispatcher.submit_all("tiny", [req])
                chunks = [c async for c in streams[0]]
                got[req.request_id] = chunks[-1].beams
            return got
        finally:
            await served.stop()

    got = asyncio.run(run())
    assert list(got["t"]) == list(want_text) and len(want_text) == 6
    assert list(got["c"]) == list(want_items) and all(b.item_id >= 0 for b in want_items)


@pytest.mark.parametrize("transport,overlapped", [("fd", False), ("grpc", True)], ids=["fd-sync", "grpc-async"])
def test_beam_search_across_a_pd_pair_equals_one_engine(tmp_path, transport, overlapped):
    np.save(tmp_path / "items.npy", np.random.default_rng(2).integers(1, 60, size=(50, 3)).astype(np.int32))
    catalog = str(tmp_path / "items.npy")
    prompt = [5 + (i * 7) % 50 for i in range(100)]  # a full page of 64 tokens and a partial one
    reqs = [_beam("t", max_tokens=5, ignore_eos=True), _beam("c", max_tokens=1, item_catalog=True)]
    for r in reqs:
        r.prompt_token_ids[:] = prompt
    reference = generate(make_engine(item_catalog=catalog), reqs)

    async def run():
        registry = EmbeddedRegistry()
        served = ServedEngines({"p": "prefill", "d": "decode"},
                               lambda: make_engine(item_catalog=catalog, async_scheduling=overlapped), transport,
                               "tiny")
        await served.start(registry)
        dispatcher = Dispatcher(registry, "tiny", Router(registry, "kv_aware"),
                                pd_metrics=PDMetrics(CollectorRegistry()))
        try:
            got = {}
            for req in reqs:
                _, streams = await dispatcher.submit_all("tiny", [req])
                assert isinstance(streams[0]._stream, PDStream), "not served by the PD pair"
                got[req.request_id] = [c async for c in streams[0]]
            p, d = served.nodes["p"].engine, served.nodes["d"].engine
            assert p.beams.counters.requests == 0 and d.beams.counters.requests == 2  # the searches ran on d
            return got
        finally:
            await served.stop()
            await registry.close()

    got = asyncio.run(asyncio.wait_for(run(), 60))
    for rid, chunks in got.items():
        assert not any(c.token_ids for c in chunks)  # no token of the prefill side reaches the client
        (stats,) = [c.disagg_stats for c in chunks if c.disagg_stats.transferred_tokens]  # the decode side's
        assert not stats.recomputed and stats.transfer_bytes > 0  # the prompt's KV came from the prefill side
        want, have = reference.final[rid].beams, chunks[-1].beams
        assert [tuple(b.token_ids) for b in have] == [tuple(b.token_ids) for b in want] and len(want) == 6
        assert [b.logprob for b in have] == pytest.approx([b.logprob for b in want], abs=1e-5)
        assert [b.item_id for b in have] == [b.item_id for b in want]

