"""The engine service's calls beside ``Generate`` that a cluster gateway makes, over gRPC: ``LoadLora`` (for
``/v1/load_lora_adapter``: an adapter loads at run time and answers with the KV hash root the engine keys its
requests by, a bad directory or a name taken is a refusal naming the field, and it unloads again) and ``Embed``
(for ``/v1/embeddings``)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from xllm.models import load_model
from xllm.testing.engine import make_engine
from xllm.testing.models import IdTokenizer, save_random_hf_model, save_random_lora
from xllm.testing.served import ServedEngine

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")


def test_load_lora_over_grpc(tmp_path):
    base = tmp_path / "base"
    save_random_hf_model(base, transformers.LlamaConfig(
        vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256), seed=3, std=0.15)
    adapter = save_random_lora(base, tmp_path / "sql", 4, 8, ["q_proj", "v_proj"], seed=11)
    engine = make_engine(load_model(base, torch.float32), tokenizer=IdTokenizer(), max_loras=2)

    async def run():
        node = await ServedEngine(engine).start()
        client = node.client
        try:
            bad = await client.load_lora("sql", str(tmp_path / "missing"))
            loaded = await client.load_lora("sql", str(adapter))
            taken = await client.load_lora("sql", str(adapter))
            roots = dict(zip(engine.lora_names(), engine.lora_hash_roots(), strict=True))
            unloaded = await client.load_lora("sql", "")
            unknown = await client.load_lora("sql", "")
            return bad, loaded, taken, roots, unloaded, unknown, engine.lora_names()
        finally:
            await node.stop()

    bad, loaded, taken, roots, unloaded, unknown, left = asyncio.run(run())
    assert (bad.ok, bad.param) == (False, "lora_path") and "sql" in bad.error
    assert loaded.ok and loaded.hash_root == roots["sql"] != 0
    assert (taken.ok, taken.param) == (False, "lora_name")
    assert unloaded.ok and (unknown.ok, unknown.param) == (False, "lora_name") and left == []


def test_embed_over_grpc_and_its_refusals():
    """``EngineService.Embed`` carries what the engine computes (HF parity: the gateway's embeddings test), and a
    refusal arrives as the engine's error naming the field."""
    from xllm.engine_api.errors import InvalidRequestError
    from xllm.proto.engine.v1 import engine_pb2

    engine = make_engine()
    want = engine.embed([5, 6, 7, 8], "mean", True)

    async def run():
        node = await ServedEngine(engine).start()
        client = node.client
        try:
            got = await client.embed(engine_pb2.EmbedRequest(prompt_token_ids=[5, 6, 7, 8], pooling="mean",
                                                             normalize=True))
            with pytest.raises(InvalidRequestError) as empty:
                await client.embed(engine_pb2.EmbedRequest(pooling="last"))
            with pytest.raises(InvalidRequestError) as pooling:
                await client.embed(engine_pb2.EmbedRequest(prompt_token_ids=[5], pooling="max"))
            healthy = (await client.health()).healthy
            return got, empty.value.param, pooling.value.param, healthy
        finally:
            await node.stop()

    got, empty, pooling, healthy = asyncio.run(run())
    assert list(got.embedding) == pytest.approx(list(want), abs=1e-6) and abs(sum(x * x for x in want) - 1) < 1e-4
    assert (empty, pooling, healthy) == ("input", "pooling", True)
