"""Prefill/decode hand-offs of image requests (a tiny random Qwen2-VL, prefill and decode engines behind their own
servers), over every transport. Oracle: HF transformers' greedy continuation with the same image (full forwards,
its own M-RoPE). The decode side never encodes an image whose prompt KV arrives; the same text with another image
matches none of the first request's KV on the decode side, the same image again matches it; a corrupted transfer
is recomputed on the decode side, the image encoded there, and the answer is still HF's. EPD: an encode
instance's embeddings are used where the prompt is prefilled (the image not encoded there), and ones that fail
their checks are recomputed."""

from __future__ import annotations

import asyncio

import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.engine.handoff.base import HandoffOptions, crc32
from xllm.engine_api.errors import InvalidRequestError
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import Collected
from xllm.testing.served import ServedEngine, corrupt_grpc_pages, pd_generate, pd_request

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from xllm.testing.models import IdTokenizer  # noqa: E402 (needs transformers)
from xllm.testing.vl_case import vl_case  # noqa: E402

NEW = 6
GREEDY = dict(max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def case(smollm2_dir, tmp_path_factory):
    """(our model, the prompt, image A, image B: B is other pixels on A's grid, so the prompts are equal, HF's)."""
    c = vl_case(smollm2_dir, tmp_path_factory.mktemp("qwen2vl"), NEW)
    return c.model, c.prompt, c.a, c.b, c.want


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


def _with_embedding(image: engine_pb2.ImageInput, embedding: engine_pb2.ImageEmbedding,
                    **changes) -> engine_pb2.ImageInput:
    out = engine_pb2.ImageInput()
    out.CopyFrom(image)
    out.embedding.CopyFrom(embedding)
    for name, value in changes.items():
        setattr(out.embedding, name, value)
    return out


def test_an_encode_instance_embeddings_answer_as_hf_and_bad_ones_are_recomputed(case):
    """EPD: an encode instance's ``Encode`` over gRPC; the instance that prefills uses its embeddings (never encodes
    the image) and answers as HF; an embedding corrupted on the way, cut short or made by other weights is not
    used: the image is encoded there instead, and the answer is still HF's."""
    model, prompt, a, _, want = case
    e_engine, p_engine = new_engine(model, "e"), new_engine(model, "p")

    async def main():
        enc = await ServedEngine(e_engine, role="encode").start()
        pre = await ServedEngine(p_engine).start()
        try:
            (good,) = (await enc.client.encode(engine_pb2.EncodeRequest(images=[a]), 30.0)).embeddings
            bad_bytes = bytearray(good.values)
            bad_bytes[40] ^= 0x10
            cases = {"good": _with_embedding(a, good),
                     "corrupt": _with_embedding(a, good, values=bytes(bad_bytes)),
                     "short": _with_embedding(a, good, values=good.values[:-4], crc32=crc32(good.values[:-4])),
                     "weights": _with_embedding(a, good, weights_identity="other@update1")}
            seen = {}
            for name, image in cases.items():
                p_engine.runner.encoder_cache = type(p_engine.runner.encoder_cache)()  # (each case from cold)
                got = Collected()
                async for chunk in await pre.client.submit(pd_request(name, 0, prompt, images=[image], **GREEDY)):
                    got.add([chunk])
                cache = p_engine.runner.encoder_cache
                seen[name] = (got.tokens[name], cache.misses, cache.received)
            with pytest.raises(InvalidRequestError, match="images"):  # a malformed image is refused, naming it
                await enc.client.encode(engine_pb2.EncodeRequest(images=[engine_pb2.ImageInput(grid_thw=[1, 2])]), 30)
            return seen, good, enc.server.counters().images_encoded
        finally:
            await enc.stop()
            await pre.stop()

    seen, good, reported = asyncio.run(main())
    hidden = model.image_embed_dim()
    assert len(good.values) == model.image_tokens(tuple(a.grid_thw)) * hidden * 4 and good.crc32 == crc32(good.values)
    assert seen["good"] == (want[b"A"], 0, 1)  # the embeddings were used: nothing encoded where it prefilled
    for name in ("corrupt", "short", "weights"):
        assert seen[name] == (want[b"A"], 1, 0), name  # not used: encoded there, the same answer
    assert e_engine.runner.encoder_cache.misses == 1  # the encode instance encoded the image once
    assert reported == 1  # and says so in its counters (heartbeats, /metrics) though it ran no step


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "decoding"])
def test_encode_calls_between_steps_are_batched_and_bounded_while_requests_run(case, busy):
    """Encode calls queued together run as one batch of the vision tower on an idle engine (an encode instance);
    while a request decodes (ed+p on a decode instance) at most the encode phase's bound (1 image) runs between
    two steps, so no decode step waits for more. Every call gets its own image's embeddings either way."""
    from xllm.core import AsyncEngine

    model, prompt, a, b, _ = case
    engine = new_engine(model, "e")
    batches: list[int] = []
    running: list[bool] = []
    real = model.encode_images

    def counted(pixels, grid):
        batches.append(len(grid))
        running.append(engine.has_work())
        return real(pixels, grid)

    c = _with_embedding(a, engine_pb2.ImageEmbedding())
    c.ClearField("embedding")
    c.content_hash = b"C"
    c.pixel_values = bytes(reversed(a.pixel_values))

    async def main():
        aeng = AsyncEngine(engine)
        if not busy:
            calls = [aeng.encode_images([image]) for image in (a, b, c)]  # queued before the loop runs: one drain
            model.encode_images = counted
            aeng.start()
        try:
            if not busy:
                return await asyncio.gather(*calls)
            aeng.start()
            stream = aiter(aeng.submit(pd_request("long", 0, prompt, images=[b], max_tokens=64, ignore_eos=True)))
            await anext(stream)  # decoding now (its image b encoded in its encode phase, cached)
            model.encode_images = counted
            got = await asyncio.gather(*(aeng.encode_images([image]) for image in (a, b, c)))
            rest = [chunk async for chunk in stream]
            assert rest[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH  # (it decoded throughout)
            return got
        finally:
            model.encode_images = real
            aeng.shutdown()
            engine.close()

    got = asyncio.run(main())
    # idle: one tower call for the three; decoding: a and c each alone between two steps (b was cached)
    assert batches == ([1, 1] if busy else [3]) and running == [busy] * len(batches)
    assert [len(g) for g in got] == [1, 1, 1] and len({g[0].values for g in got}) == 3
    assert all(g[0].crc32 == crc32(g[0].values) for g in got)


def test_a_weight_update_forgets_the_cached_image_embeddings(smollm2_dir, tmp_path):
    """An engine loaded from checkpoint A encodes an image (cached); after ``update_weights`` to checkpoint B the
    same image's ``Encode`` is B's tower's output, not the cached A one."""
    from transformers import AutoTokenizer

    from xllm.core import AsyncEngine
    from xllm.engine.loader import load_engine
    from xllm.models.qwen_vl import load_qwen_vl
    from xllm.testing.models import VISION_TOKENS, flatten_vl_config, save_random_vl, tiny_qwen_vl_config

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    config = tiny_qwen_vl_config("qwen2_vl", len(tok), {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS})
    dirs = {name: tmp_path / name for name in ("a", "b")}
    for seed, path in enumerate(dirs.values()):
        save_random_vl(config, path, seed=seed)
        flatten_vl_config(path, path)
        tok.save_pretrained(path)
    c = vl_case(smollm2_dir, tmp_path / "case", NEW)  # (its image only)
    pixels = torch.frombuffer(bytearray(c.a.pixel_values), dtype=torch.float32).view(-1, len(c.a.pixel_values) // 4)
    grid = torch.tensor([list(c.a.grid_thw)])
    with torch.inference_mode():
        want = {name: load_qwen_vl(path, torch.float32).encode_images(pixels.view(int(grid.prod()), -1), grid)[0]
                for name, path in dirs.items()}
    loaded = load_engine(str(dirs["a"]), "vl", EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05,
                                                            max_model_len=256, num_threads=1), "e", progress=False)

    async def main():
        aeng = AsyncEngine(loaded.engine, compute=loaded.compute)
        aeng.start()
        try:
            before = (await aeng.encode_images([c.a]))[0]
            await aeng.update_weights(str(dirs["b"]))
            after = (await aeng.encode_images([c.a]))[0]
            return before, after
        finally:
            aeng.shutdown()
            loaded.engine.close()
            loaded.compute.shutdown()

    before, after = asyncio.run(main())
    values = {k: torch.frombuffer(bytearray(v.values), dtype=torch.float32) for k, v in (("a", before), ("b", after))}
    assert (want["a"] - want["b"]).abs().max() > 0.1  # (the checkpoints differ)
    for name in ("a", "b"):  # (the engine's thread count may round the last bits differently)
        torch.testing.assert_close(values[name], want[name].flatten(), rtol=1e-4, atol=1e-5)
    assert after.weights_identity.endswith("@update1")  # (and it says which weights made it)
