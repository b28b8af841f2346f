"""``EngineService.Control`` over gRPC (what a cluster gateway's ``/sleep``, ``/wake_up``, ``/is_sleeping`` and
``/update_weights`` call): a tiny random Llama A sleeps (``Generate`` is then refused as overloaded, saying the
model sleeps and how to wake it), wakes, is updated in place to B (its greedy tokens then equal HF's on B), and
a bad directory is a refusal naming ``model_path``."""

from __future__ import annotations

import asyncio

import pytest
import torch

from xllm.engine_api.errors import EngineOverloadedError
from xllm.models import load_model
from xllm.models.reload import read_weights
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import make_engine, make_request
from xllm.testing.models import IdTokenizer, save_random_hf_model
from xllm.testing.served import ServedEngine

transformers = pytest.importorskip("transformers")

PROMPT = [1, 17, 230, 45, 99, 5, 61]
NEW = 6


def _config():
    return transformers.LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=256)


@torch.inference_mode()
def _hf(model_dir) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW,
                       do_sample=False)[0, len(PROMPT):].tolist()


def test_control_over_grpc(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    save_random_hf_model(a, _config(), seed=3)
    save_random_hf_model(b, _config(), seed=4)
    engine = make_engine(load_model(a, torch.float32), tokenizer=IdTokenizer())
    engine.attach_weights(str(a), read_weights)

    def control(action, **kw) -> engine_pb2.ControlRequest:
        return engine_pb2.ControlRequest(action=action, **kw)

    async def generate(client, rid: str) -> list[int]:
        stream = await client.submit(make_request(rid, PROMPT, max_tokens=NEW, ignore_eos=True))
        return [t async for chunk in stream for t in chunk.token_ids]

    async def run():
        node = await ServedEngine(engine).start()
        client = node.client
        try:
            before = await generate(client, "r0")
            slept = await client.control(control(engine_pb2.CONTROL_ACTION_SLEEP, level=1))
            asked = await client.control(control(engine_pb2.CONTROL_ACTION_IS_SLEEPING))
            with pytest.raises(EngineOverloadedError) as refused:
                await generate(client, "r1")
            woke = await client.control(control(engine_pb2.CONTROL_ACTION_WAKE_UP))
            bad = await client.control(control(engine_pb2.CONTROL_ACTION_UPDATE_WEIGHTS,
                                               model_path=str(tmp_path / "missing")))
            updated = await client.control(control(engine_pb2.CONTROL_ACTION_UPDATE_WEIGHTS, model_path=str(b)))
            after = await generate(client, "r2")
            deep = await client.control(control(engine_pb2.CONTROL_ACTION_SLEEP, level=2))
            await client.control(control(engine_pb2.CONTROL_ACTION_WAKE_UP))
            again = await generate(client, "r3")
            return before, slept, asked, str(refused.value), woke, bad, updated, after, deep, again
        finally:
            await node.stop()

    before, slept, asked, refused, woke, bad, updated, after, deep, again = asyncio.run(run())
    assert before == _hf(a)
    assert slept.ok and slept.sleeping_level == 1 and asked.sleeping_level == 1
    assert "sleeping" in refused and "/wake_up" in refused
    assert woke.ok and woke.woke_from == 1 and woke.sleeping_level == 0
    assert (bad.ok, bad.param) == (False, "model_path") and "not a directory" in bad.error
    assert updated.ok and updated.weights_identity
    assert after == _hf(b) != before
    assert deep.ok and deep.sleeping_level == 2
    assert again == after  # level 2 read B's weights again (the last update's directory)
