"""EPD disaggregation through the gateway's dispatcher, over real engine servers in this process (a tiny random
Qwen2-VL): with ``e+p+d`` an encode instance encodes the request's image and the prefill instance uses its
embeddings (never encoding it), with ``ed+p`` a decode instance does; the answer equals HF transformers' greedy
continuation (and, seeded, an engine serving the request whole). An encode instance that dies mid-encode, or
none being live, leaves the image to the prefill instance: the same answer, counted as a fallback. A prefill
instance that dies after the encode leaves the embeddings to the next one: encoded once, the same answer."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from prometheus_client import CollectorRegistry

from xllm.core import EngineConfig, LLMEngine
from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.encode import EncodeMetrics, EncodeStage, EPDOptions
from xllm.gateway.metrics import PDMetrics
from xllm.gateway.registry import EmbeddedRegistry
from xllm.gateway.router import Router
from xllm.proto.engine.v1 import engine_pb2
from xllm.sched import EPD_STRATEGIES
from xllm.testing.engine import Collected, generate, make_request
from xllm.testing.served import ServedEngines

pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")

from xllm.testing.models import IdTokenizer
from xllm.testing.vl_case import vl_case

MODEL = "vl"
NEW = 6
GREEDY = dict(max_tokens=NEW, ignore_eos=True)
SEEDED = dict(max_tokens=NEW, temperature=0.9, seed=11, ignore_eos=True)
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def case(smollm2_dir, tmp_path_factory):
    return vl_case(smollm2_dir, tmp_path_factory.mktemp("qwen2vl"), NEW)


def new_engine(model) -> LLMEngine:
    return LLMEngine(model, IdTokenizer(), EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05,
                                                        max_model_len=256, max_num_seqs=4, num_threads=1,
                                                        block_size=32))


class Cluster:
    """Instances of ``roles`` registered with one in-process registry, and a dispatcher whose encode stage
    follows ``strategy``."""

    def __init__(self, model, roles: dict[str, str], strategy: str) -> None:
        self.registry = EmbeddedRegistry()
        self.served = ServedEngines(roles, lambda: new_engine(model), "grpc", MODEL)
        self.nodes = self.served.nodes
        self.prom = CollectorRegistry()
        router = Router(self.registry, "kv_aware")
        self.dispatcher = Dispatcher(self.registry, MODEL, router, pd_metrics=PDMetrics(self.prom),
                                     encoder=EncodeStage(router, EPDOptions(EPD_STRATEGIES.get(strategy)),
                                                         EncodeMetrics(self.prom)))

    async def __aenter__(self) -> Cluster:
        await self.served.start(self.registry)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.served.stop()
        await self.registry.close()

    def metric(self, name: str, **labels: str) -> float:
        return self.prom.get_sample_value(name, {"model_name": MODEL, **labels}) or 0.0

    def cache(self, iid: str):
        """Instance ``iid``'s encoder cache (its counters: images encoded, embeddings received)."""
        return self.nodes[iid].engine.runner.encoder_cache

    async def generate(self, rid: str, case, **sampling) -> Collected:
        req = make_request(rid, case.prompt, **sampling)
        req.images.append(case.a)
        _, streams = await self.dispatcher.submit_all(MODEL, [req])
        got = Collected()
        async for chunk in streams[0]:
            got.add([chunk])
        return got


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


@pytest.mark.parametrize(("strategy", "roles", "encoder"), [
    ("e+p+d", {"e": "encode", "p": "prefill", "d": "decode"}, "e"),
    ("ed+p", {"p": "prefill", "d": "decode"}, "d"),
])
def test_images_are_encoded_where_the_strategy_says_and_answer_as_hf(case, strategy, roles, encoder):
    async def main():
        async with Cluster(case.model, roles, strategy) as c:
            greedy = await c.generate("g", case, **GREEDY)
            seeded = await c.generate("s", case, **SEEDED)
            return (greedy, seeded, c.cache(encoder).misses, c.cache("p").misses, c.cache("p").received,
                    c.metric("xllm:epd_encodes_total", instance=encoder),
                    c.metric("xllm:epd_encode_fallbacks_total", reason="failed"))

    greedy, seeded, encoded, p_encoded, p_received, calls, fallbacks = run(main())
    assert greedy.tokens["g"] == case.want[b"A"]
    assert greedy.final["g"].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    whole = make_request("s", case.prompt, **SEEDED)
    whole.images.append(case.a)
    ref = generate(new_engine(case.model), [whole])  # the unsplit run: one engine, the image encoded there
    assert seeded.tokens["s"] == ref.tokens["s"] and seeded.text["s"] == ref.text["s"]
    assert seeded.final["s"].finish_reason == ref.final["s"].finish_reason
    # the image was encoded once, where the strategy says; the prefill instance used the embeddings both times
    assert (encoded, p_encoded, p_received, calls, fallbacks) == (1, 0, 1, 2, 0)


def test_an_encode_instance_dying_mid_encode_leaves_the_image_to_the_prefill_instance(case):
    started, release = threading.Event(), threading.Event()

    async def main():
        async with Cluster(case.model, {"e": "encode", "p": "prefill", "d": "decode"}, "e+p+d") as c:
            e = c.nodes["e"]
            runner = e.engine.runner
            real = runner.encode_requests

            def stuck(*args):  # the encode instance hangs in its vision tower
                started.set()
                release.wait(TIMEOUT)
                return real(*args)

            runner.encode_requests = stuck
            task = asyncio.ensure_future(c.generate("k", case, **GREEDY))
            await asyncio.to_thread(started.wait, TIMEOUT)
            await e.server.stop(0)  # it dies mid-encode: its calls break
            try:
                got = await task
            finally:
                release.set()
            after = await c.generate("n", case, **GREEDY)  # its breaker is open: no encode instance is live
            return (got, after, c.cache("p").misses, c.cache("p").received,
                    c.metric("xllm:epd_encode_fallbacks_total", reason="failed"),
                    c.metric("xllm:epd_encode_fallbacks_total", reason="no_instance"))

    got, after, p_encoded, p_received, failed, none_live = run(main())
    assert got.tokens["k"] == after.tokens["n"] == case.want[b"A"]
    assert got.final["k"].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert (p_encoded, p_received, failed, none_live) == (1, 0, 1, 1)  # encoded once there, then cached


def test_a_prefill_instance_dying_after_the_encode_leaves_the_embeddings_to_the_next_one(case):
    """The image is encoded once on the encode instance; the prefill instance the request goes to dies while
    taking it; the other one prefills it with the same embeddings (encoding nothing) and the answer is HF's."""
    died: list[str] = []

    def die_on_first_request(node) -> None:
        submit = node.aeng.submit_async

        async def submit_async(req, trace=None):
            if died:
                return await submit(req, trace)
            died.append(node.instance_id)
            stopping = asyncio.ensure_future(node.server.stop(0))  # it dies while accepting the call
            await asyncio.Event().wait()  # (cancelled with the call, by the stop)
            del stopping

        node.aeng.submit_async = submit_async

    async def main():
        roles = {"e": "encode", "p1": "prefill", "p2": "prefill", "d": "decode"}
        async with Cluster(case.model, roles, "e+p+d") as c:
            for iid in ("p1", "p2"):
                die_on_first_request(c.nodes[iid])
            got = await c.generate("r", case, **GREEDY)
            survivor = "p2" if died == ["p1"] else "p1"
            return (got, c.cache("e").misses, c.cache(survivor).misses, c.cache(survivor).received,
                    c.metric("xllm:epd_encodes_total", instance="e"),
                    c.metric("xllm:pd_prefill_retries_total", instance=died[0]))

    got, encoded, p_encoded, p_received, calls, retries = run(main())
    assert len(died) == 1 and retries == 1
    assert got.tokens["r"] == case.want[b"A"]
    assert (encoded, calls, p_encoded, p_received) == (1, 1, 0, 1)
