"""Gateway <-> engines over gRPC in one process: registration with heartbeats, KV-aware dispatch and
resuming a stream on another instance, with greedy text equal to an uninterrupted run (real SmolLM2, fp32).
The client's error mapping is tested in xllm-engine (test_client.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.registry import EmbeddedRegistry
from xllm.gateway.router import Router
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import unit_block_size
from xllm.testing.processes import until
from xllm.testing.served import ServedEngine

pytestmark = pytest.mark.real_model

MODEL = "smol"


def node(model, tokenizer, instance_id: str, **cfg) -> ServedEngine:
    """One engine instance served over gRPC in this process."""
    cfg = {"dtype": torch.float32, "kv_cache_memory_gib": 0.05, "max_model_len": 512, "max_num_seqs": 4,
           "num_threads": 1, "block_size": unit_block_size(model), **cfg}
    return ServedEngine(LLMEngine(model, tokenizer, EngineConfig(**cfg), instance_id=instance_id), model=MODEL)


def _req(rid: str, prompt: list[int], max_tokens: int, **sp) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=engine_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sp))


async def _drain(stream) -> list[engine_pb2.GenerateResponse]:
    return [chunk async for chunk in stream]


def test_dispatch_follows_the_cache_and_resumes_a_broken_stream(smollm2_fp32, smollm2_tokenizer):
    tok = smollm2_tokenizer
    system = tok.encode("You are a concise assistant for a train company. " * 8)
    question = tok.encode(" Question: when does the first train leave?")

    async def run():
        registry = EmbeddedRegistry()
        nodes = [node(smollm2_fp32, tok, iid) for iid in ("a", "b")]
        for n in nodes:
            await n.start(registry)
        dispatcher = Dispatcher(registry, MODEL, Router(registry, "kv_aware"))
        try:
            assert {s.instance_id for s in registry.states()} == {"a", "b"}
            prompt = system + question
            client, streams = await dispatcher.submit_all(MODEL, [_req("r1", prompt, 3)])
            await _drain(streams[0])
            home = client.info.instance_id
            # the next heartbeats carry its prefix blocks into the global index
            await until(lambda: registry.kv_index.num_blocks(home), 10, "the prefix blocks in the global index")
            client2, streams = await dispatcher.submit_all(MODEL, [_req("r2", system + tok.encode(" Hi"), 3)])
            chunks = await _drain(streams[0])
            assert client2.info.instance_id == home
            assert chunks[-1].usage.cached_prompt_tokens > 0

            # the reference: the whole answer from one instance
            other = next(n for n in nodes if n.info.instance_id != home)
            ref = await _drain(await other.client.submit(_req("ref", prompt, 24)))
            ref_tokens = [t for c in ref for t in c.token_ids]

            # start on one instance (both hold the prompt's prefix now), shut it down after a few tokens:
            # the stream continues on the other one
            client3, streams = await dispatcher.submit_all(MODEL, [_req("r3", prompt, 24)])
            first = next(n for n in nodes if n.info.instance_id == client3.info.instance_id)
            got: list[engine_pb2.GenerateResponse] = []
            stopper = None
            async for chunk in streams[0]:
                got.append(chunk)
                if len(got) == 4:
                    stopper = asyncio.ensure_future(first.stop())
            await stopper
            tokens = [t for c in got for t in c.token_ids]
            assert streams[0].resumes == 1
            assert len(tokens) == 24 and got[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
            assert got[-1].usage.prompt_tokens == len(prompt) and got[-1].usage.completion_tokens == 24
            assert tokens == ref_tokens  # nothing lost, nothing repeated (greedy)
            assert "".join(c.text for c in got) == "".join(c.text for c in ref)
        finally:
            for n in nodes:
                await n.stop()
            await registry.close()

    asyncio.run(run())
