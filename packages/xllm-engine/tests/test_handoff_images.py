"""Prefill/decode hand-offs of image requests (a tiny random Qwen2-VL, prefill and decode engines behind their own
servers), over every transport. Oracle: HF transformers' greedy continuation with the same image (full forwards,
its own M-RoPE). The decode side never encodes an image whose prompt KV arrives; the same text with another image
matches none of the first request's KV on the decode side, the same image again matches it; a corrupted transfer
is recomputed on the decode side, the image encoded there, and the answer is still HF's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.engine.handoff.base import HandoffOptions
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.served import ServedEngine, corrupt_grpc_pages, pd_generate

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from xllm.testing.models import (  # noqa: E402 (needs transformers)
    VISION_TOKENS,
    IdTokenizer,
    hf_greedy_with_images,
    save_random_vl,
    tiny_qwen_vl_config,
)

NEW = 6
GREEDY = dict(max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def case(smollm2_dir, tmp_path_factory):
    """(our model, HF's, the prompt, image A, image B: B is other pixels on A's grid, so the prompts are equal)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from xllm.models.qwen_vl import load_qwen_vl

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    path = tmp_path_factory.mktemp("qwen2vl")
    hf = save_random_vl(tiny_qwen_vl_config("qwen2_vl", len(tok), ids), path)
    ours = load_qwen_vl(path, torch.float32)
    g = torch.Generator().manual_seed(5)
    pic = PIL.fromarray(torch.randint(0, 256, (84, 56, 3), generator=g, dtype=torch.uint8).numpy())
    out = Qwen2VLImageProcessorPil()(images=[pic], return_tensors="pt")
    pixels, grid = out["pixel_values"].float().contiguous(), out["image_grid_thw"]
    run = [ids["<|vision_start|>"]] + [ours.image_token_id] * int(grid.prod() // 4) + [ids["<|vision_end|>"]]
    prompt = tok("A long shared preamble, " * 8)["input_ids"] + run + tok(" What is it?")["input_ids"]

    def image(values: torch.Tensor, tag: bytes) -> engine_pb2.ImageInput:
        return engine_pb2.ImageInput(pixel_values=values.numpy().tobytes(), grid_thw=grid[0].tolist(),
                                     content_hash=tag)

    other = pixels.flip(0).contiguous()
    with torch.inference_mode():
        want = {tag: hf_greedy_with_images(hf, prompt, values, grid, ours.image_token_id, NEW)
                for tag, values in ((b"A", pixels), (b"B", other))}
    assert want[b"A"] != want[b"B"]  # (the image matters)
    return ours, prompt, image(pixels, b"A"), image(other, b"B"), want


def new_engine(model, name: str, **tiers) -> LLMEngine:
    return LLMEngine(model, IdTokenizer(), EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05,
                                                        max_model_len=256, max_num_seqs=4, num_threads=1,
                                                        block_size=32, **tiers), instance_id=name)


@pytest.fixture(scope="module")
def mooncake_tiers(tmp_path_factory):
    from xllm.testing.processes import start_mooncake_master

    store = start_mooncake_master(tmp_path_factory.mktemp("mooncake"))
    yield {"kv_model_identity": "handoff-images", "kv_store": store.url, "kv_store_metadata": store.metadata_url,
           "kv_store_segment_gib": 0.0625}
    store.stop(timeout=20)


@pytest.mark.parametrize("transport", ["fd", "grpc", "mooncake"])
def test_image_requests_hand_off_and_answer_as_hf(case, transport, request):
    model, prompt, a, b, want = case
    tiers = request.getfixturevalue("mooncake_tiers") if transport == "mooncake" else {}
    d_engine = new_engine(model, "d", **tiers)

    async def main():
        prefill = await ServedEngine(new_engine(model, "p", **tiers), handoff=HandoffOptions(transport="grpc")).start()
        decode = await ServedEngine(d_engine, handoff=HandoffOptions(transport=transport)).start()
        try:
            return [await pd_generate(prefill, decode, rid, prompt, images=[image], **GREEDY)
                    for rid, image in (("a", a), ("b", b), ("a2", a))]
        finally:
            await prefill.stop()
            await decode.stop()

    results = asyncio.run(main())
    for (got, _, stats), (rid, tag) in zip(results, (("a", b"A"), ("b", b"B"), ("a2", b"A")), strict=True):
        assert got.tokens[rid] == want[tag], rid
        assert got.final[rid].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert stats is not None and stats.transport == transport and not stats.recomputed, stats
    (_, first, _), (_, other, _), (_, again, _) = results
    # the decode side's prefix cache: nothing of image A's KV for image B's request (same tokens), all but the
    # partial last block of it for image A's again
    assert first.matched_tokens == 0 and other.matched_tokens == 0
    assert again.matched_tokens == len(prompt) // 32 * 32 > 0
    assert d_engine.runner.encoder_cache.misses == 0  # the decode side got the KV: it never encoded an image


def test_a_corrupted_image_prompt_transfer_is_recomputed_on_the_decode_side(case, monkeypatch):
    model, prompt, a, _, want = case
    corrupt_grpc_pages(monkeypatch, 0)  # one byte of the first range changes on the wire
    d_engine = new_engine(model, "d")

    async def main():
        prefill = await ServedEngine(new_engine(model, "p"), handoff=HandoffOptions(transport="grpc")).start()
        decode = await ServedEngine(d_engine, handoff=HandoffOptions(transport="grpc")).start()
        try:
            return await pd_generate(prefill, decode, "r", prompt, images=[a], **GREEDY)
        finally:
            await prefill.stop()
            await decode.stop()

    got, _, stats = asyncio.run(main())
    assert stats.recomputed and "corrupted" in stats.failure
    assert got.tokens["r"] == want[b"A"]
    assert d_engine.runner.encoder_cache.misses == 1  # the decode side computed the prompt: it encoded the image
