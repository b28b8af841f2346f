"""SmolLM2 (real weights) with KV tiers below its KV memory: a shared system prompt evicted from
the engine's memory comes back from the host (T1) tier, and after a restart from the disk (T2) tier,
and the greedy outputs equal Hugging Face's."""

from __future__ import annotations

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.kvstore import block_hashes
from xllm.kvstore.tier import model_identity
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import unit_block_size

pytest.importorskip("transformers")
pytestmark = pytest.mark.real_model

NEW = 12
SYSTEM = ("You are a careful assistant for a hardware store. Answer in one short sentence, name the aisle, "
          "and never invent products that the store does not sell.")
OTHER = ("You are a terse librarian. Recommend exactly one book per question, give its author, and say nothing "
         "about films, music or anything that is not printed on paper.")


def engine(model, tokenizer, tmp_path, identity, host: bool, longest: int) -> LLMEngine:
    probe = LLMEngine(model, tokenizer, EngineConfig(dtype=torch.float32, max_model_len=256, num_threads=1,
                                                     kv_cache_memory_gib=0.01, block_size=unit_block_size(model)))
    bs, per_block = probe.layout.block_size, probe.kv.page_store().block_bytes
    probe.close()
    blocks = -(-(longest + NEW) // bs) + 1  # room for one conversation: the next one evicts the last
    return LLMEngine(model, tokenizer, EngineConfig(
        dtype=torch.float32, max_model_len=256, num_threads=1, kv_cache_memory_gib=blocks * per_block / 2**30,
        block_size=bs,
        kv_model_identity=identity, kv_host_memory_gib=0.05 if host else None, kv_host_dir=str(tmp_path / "host"),
        kv_disk_dir=str(tmp_path / "disk"), kv_disk_size_gib=0.1))


def greedy(eng: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
    sampling = engine_pb2.SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    eng.add_request(engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling))
    out: list[int] = []
    while eng.has_work():
        out += [t for c in eng.step() if c.request_id == rid for t in c.token_ids]
    return out


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int]) -> list[int]:
    return hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                       min_new_tokens=NEW)[0, len(prompt):].tolist()


def test_a_system_prompt_reloaded_from_host_then_disk_gives_hf_outputs(smollm2_dir, smollm2_fp32, hf_smollm2_fp32,
                                                                       smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer
    chat = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
            for system, q in ((SYSTEM, "Where are the hammers?"), (OTHER, "A book about the sea?"),
                              (SYSTEM, "Do you sell paint?"), (SYSTEM, "I need screws for wood."))]
    identity = model_identity(smollm2_dir)
    eng = engine(smollm2_fp32, tok, tmp_path, identity, host=True, longest=max(map(len, chat)))
    try:
        outs = [greedy(eng, f"r{i}", p) for i, p in enumerate(chat[:2])]  # r1 evicts r0's system prompt
        # r0's blocks were queued for the tiers when r1 evicted them; until the writer stores them, a
        # lookup serves them from the queue instead (a correct hit, but not the host tier's)
        assert eng.kv.lower.store.flush(30)
        outs.append(greedy(eng, "r2", chat[2]))
        bs = eng.layout.block_size
        shared = block_hashes(chat[0], bs)[:len(block_hashes(chat[2], bs))]
        common = sum(1 for a, b in zip(shared, block_hashes(chat[2], bs), strict=False) if a == b)
        assert common >= 2
        assert eng.kv.tier_stats()["host"].hits >= common  # r2's system prompt came up from T1
        assert eng.kv.lower.store.flush(30)
    finally:
        eng.close()
    # restarted, with the disk tier only
    again = engine(smollm2_fp32, tok, tmp_path, identity, host=False, longest=max(map(len, chat)))
    try:
        outs.append(greedy(again, "r3", chat[3]))
        assert again.kv.tier_stats()["disk"].hits >= 2
    finally:
        again.close()
    for i in (2, 3):  # the requests served from a lower tier (the others: test_kv_backends_parity)
        assert outs[i] == hf_greedy(hf_smollm2_fp32, chat[i]), f"r{i} diverges from HF"
