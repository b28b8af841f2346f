"""Prompt logprobs in PD mode, on SmolLM2 (fp32): a prefill and a decode instance behind loopback
gRPC, driven by the gateway's dispatcher. The prompt's logprobs (what ``echo`` + ``logprobs`` and
``prompt_logprobs`` are built from: computed by the prefill instance, carried on the request's first
chunk) equal HF's teacher-forced ``log_softmax`` — with the prompt prefilled in chunks, and again
when the prompt is in both instances' prefix caches — and arrive once (the decode instance, which
receives the KV, adds none). The generated tokens equal a mixed engine's."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import CollectorRegistry

from xllm.core import EngineConfig, LLMEngine
from xllm.gateway.disagg import PDStream
from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.metrics import PDMetrics
from xllm.gateway.registry import EmbeddedRegistry
from xllm.gateway.router import Router
from xllm.testing.engine import Collected, generate, make_request
from xllm.testing.served import ServedEngines

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is Paris, the capital of Italy is Rome, and the capital of Spain is"
SAMPLING = dict(max_tokens=4, prompt_logprobs=2)


@torch.inference_mode()
def hf_prompt_logprobs(hf, ids: list[int]) -> tuple[list[float], list[list[float]]]:
    """Each prompt token's teacher-forced logprob, and the two largest of its row."""
    rows = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return rows.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist(), rows.topk(2).values.tolist()


def test_prompt_logprobs_through_a_pd_pair_equal_hf(smollm2_fp32, smollm2_tokenizer, hf_smollm2_fp32):
    tok = smollm2_tokenizer
    ids = tok.encode(PROMPT)
    expected, expected_top = hf_prompt_logprobs(hf_smollm2_fp32, ids)

    def engine(budget: int = 8) -> LLMEngine:  # a budget below the prompt: the prefill runs in chunks
        return LLMEngine(smollm2_fp32, tok, EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05,
                                                         max_model_len=256, num_threads=1,
                                                         max_num_batched_tokens=budget))

    mixed = generate(engine(), [make_request("m", ids, **SAMPLING)])
    registry = EmbeddedRegistry()
    served = ServedEngines({"p": "prefill", "d": "decode"}, engine, "fd", MODEL)
    dispatcher = Dispatcher(registry, MODEL, Router(registry, "kv_aware"), pd_metrics=PDMetrics(CollectorRegistry()))

    async def main() -> list[tuple[Collected, list, bool]]:
        await served.start(registry)
        try:
            runs = []
            for i in range(2):  # the second time, both instances hold the prompt in their prefix caches
                rid = f"r{i}"
                _, (stream,) = await dispatcher.submit_all(MODEL, [make_request(rid, ids, **SAMPLING)])
                got, carrying = Collected(), []
                async for chunk in stream:
                    got.add([chunk])
                    carrying.append(list(chunk.prompt_logprobs))
                runs.append((got, carrying, isinstance(stream._stream, PDStream)))
            return runs
        finally:
            await served.stop()
            await registry.close()

    for i, (got, carrying, pd) in enumerate(asyncio.run(asyncio.wait_for(main(), 120))):
        rid = f"r{i}"
        assert pd, "the request did not go through the PD pair"
        assert got.tokens[rid] == mixed.tokens["m"]
        first = carrying[0]
        assert not any(carrying[1:]), "prompt logprobs after the first chunk"
        assert [e.token_id for e in first] == ids[1:]
        assert max(abs(e.logprob - want) for e, want in zip(first, expected, strict=True)) < 1e-3
        tops = [[t.logprob for t in e.top] for e in first]
        assert max(abs(a - b) for got_top, want in zip(tops, expected_top, strict=True)
                   for a, b in zip(got_top, want, strict=True)) < 1e-3
