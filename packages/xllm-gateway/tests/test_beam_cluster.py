"""Beam search through the cluster path: a gateway dispatcher and an engine served over gRPC (in one
process, the tiny model): the hypotheses arrive as the in-process engine gives them; a PD cluster
refuses beam requests with a 400 naming the field."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.openai.errors import APIError
from xllm.gateway.registry import EmbeddedRegistry
from xllm.gateway.router import Router
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import generate, make_engine
from xllm.testing.served import ServedEngine


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


def test_a_pd_cluster_refuses_beam_search():
    class PDRouter:  # a router that sees prefill and decode pools
        def pd_pools(self, model, exclude):
            return ["p"], ["d"]

    dispatcher = Dispatcher(EmbeddedRegistry(), "tiny", PDRouter())
    with pytest.raises(APIError) as err:
        asyncio.run(dispatcher.submit_all("tiny", [_beam("x", max_tokens=3)]))
    assert err.value.status == 400 and err.value.body()["error"]["param"] == "use_beam_search"
