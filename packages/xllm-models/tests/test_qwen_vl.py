"""Qwen2-VL / Qwen2.5-VL (:mod:`xllm.models.qwen_vl`, :mod:`xllm.models.vision`) against HF transformers: tiny
random-weight models saved by HF with SmolLM2's tokenizer plus the vision special tokens, images from HF's PIL
image processor. The vision tower, the M-RoPE positions and the full-prompt logits (no, one and two images of
different sizes) must equal HF's."""

from __future__ import annotations

import pytest
import torch

from xllm.testing.models import (
    VISION_TOKENS,
    flatten_vl_config,
    hf_greedy_with_images,
    save_random_vl,
    tiny_qwen_vl_config,
)

IMAGE_SIZES = [(56, 84), (112, 56)]  # (width, height): patch grids 6x4 and 4x8


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tok


@pytest.fixture(scope="module")
def images():
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    g = torch.Generator().manual_seed(3)
    pics = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
            for w, h in IMAGE_SIZES]
    out = Qwen2VLImageProcessorPil()(images=pics, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def models(request, tokenizer, tmp_path_factory, one_torch_thread):
    from xllm.models.qwen_vl import load_qwen_vl

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_vl(tiny_qwen_vl_config(request.param, len(tokenizer), ids), path)
    tokenizer.save_pretrained(path)
    return hf, load_qwen_vl(path, torch.float32), path


def _prompt(tokenizer, model, grid_thw: torch.Tensor) -> torch.Tensor:
    """Text, then each image's vision_start, image pads and vision_end, text between and after."""
    ids = tokenizer("Describe what you see:")["input_ids"]
    start, pad, end = (tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS[:3])
    for i, (t, h, w) in enumerate(grid_thw.tolist()):
        ids += [start] + [pad] * (t * h * w // model.vision_cfg.merge_unit) + [end]
        ids += tokenizer(f" and picture {i} is here")["input_ids"]
    return torch.tensor(ids)


def _patches(pixel_values: torch.Tensor, grid_thw: torch.Tensor, which: list[int]) -> torch.Tensor:
    counts = grid_thw.prod(-1).tolist()
    parts = pixel_values.split(counts)
    return torch.cat([parts[i] for i in which])


@torch.inference_mode()
def test_vision_tower_matches_hf(models, images):
    hf, ours, _ = models
    pixel_values, grid = images
    assert grid.tolist() == [[1, 6, 4], [1, 4, 8]]
    expect = hf.model.visual(pixel_values, grid_thw=grid).pooler_output
    got = ours.encode_images(pixel_values, grid)
    assert [e.shape[0] for e in got] == [6, 8]
    torch.testing.assert_close(torch.cat(got), expect, atol=2e-5, rtol=1e-5)
    # an image alone encodes as in the batch (images never attend to each other)
    alone = ours.encode_images(_patches(pixel_values, grid, [1]), grid[1:])
    torch.testing.assert_close(alone[0], got[1], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("which", [[], [0], [1, 0]])
@torch.inference_mode()
def test_mrope_positions_match_hf(models, images, tokenizer, which):
    hf, ours, _ = models
    grid = images[1][which] if which else None
    ids = _prompt(tokenizer, ours, grid if grid is not None else torch.zeros(0, 3, dtype=torch.int64))
    positions, delta = ours.mrope_positions(ids, grid)
    if grid is None:
        assert delta == 0 and torch.equal(positions, torch.arange(len(ids)).expand(3, -1))
        return
    types = (ids == ours.image_token_id).int()[None]
    expect, expect_delta = hf.model.get_rope_index(ids[None], types, image_grid_thw=grid)
    assert torch.equal(positions, expect[:, 0])
    assert delta == int(expect_delta) and delta < 0


@pytest.mark.parametrize("which", [[], [0], [1, 0]])
@torch.inference_mode()
def test_logits_match_hf(models, images, tokenizer, which):
    from xllm.testing.reference import DenseContext

    hf, ours, _ = models
    pixel_values, all_grid = images
    grid = all_grid[which] if which else torch.zeros(0, 3, dtype=torch.int64)
    ids = _prompt(tokenizer, ours, grid)
    if which:
        pv = _patches(pixel_values, all_grid, which)
        types = (ids == ours.image_token_id).int()[None]
        expect = hf(input_ids=ids[None], pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=types).logits[0]
        positions, _ = ours.mrope_positions(ids, grid)
        embeds = torch.cat(ours.encode_images(pv, grid))
        hidden = ours.forward(ids, torch.arange(len(ids)), DenseContext(), mrope_positions=positions,
                              image_embeds=embeds)
    else:
        expect = hf(input_ids=ids[None]).logits[0]
        hidden = ours.forward(ids, torch.arange(len(ids)), DenseContext())
    got = ours.compute_logits(hidden)
    assert got.shape == expect.shape
    torch.testing.assert_close(got, expect, atol=5e-4, rtol=1e-4)


@torch.inference_mode()
def test_image_changes_logits_and_bad_inputs_fail(models, images, tokenizer):
    """The images matter (a wrong image changes the text's logits: the test above would see a dropped
    image), and mismatched image rows are refused."""
    from xllm.testing.reference import DenseContext

    _, ours, _ = models
    pixel_values, grid = images
    ids = _prompt(tokenizer, ours, grid[:1])
    positions, _ = ours.mrope_positions(ids, grid[:1])
    embeds = ours.encode_images(_patches(pixel_values, grid, [0]), grid[:1])[0]
    base = ours.forward(ids, torch.arange(len(ids)), DenseContext(), mrope_positions=positions, image_embeds=embeds)
    other = ours.forward(ids, torch.arange(len(ids)), DenseContext(), mrope_positions=positions,
                         image_embeds=embeds.flip(0))
    assert (base[-1] - other[-1]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="image_embeds has 5 rows for 6 image tokens"):
        ours.forward(ids, torch.arange(len(ids)), DenseContext(), image_embeds=embeds[:5])
    with pytest.raises(ValueError, match="needs 8 image tokens"):
        ours.mrope_positions(ids, grid[1:])


@torch.inference_mode()
def test_text_only_request_through_engine(models, tokenizer, tmp_path):
    """The registered architecture loads through the engine's loader from a directory laid out as the hub's
    checkpoints are (text fields at the top of config.json, ``model.*`` / ``visual.*`` tensor names), and a
    text-only request decodes HF's greedy tokens (the plain Qwen2 path, native fused steps where they run)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from xllm.models import load_model
    from xllm.models.qwen_vl import _our_name
    from xllm.testing.models import IdTokenizer, run_engine

    hf, _, path = models
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    raw = flatten_vl_config(path, tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    tensors = {_our_name(n): t for n, t in load_file(file).items()}  # (transformers 5 may save these names)
    assert any(n.startswith("model.layers.") for n in tensors) and any(n.startswith("visual.") for n in tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    model = load_model(tmp_path, torch.float32, progress=False)
    assert type(model).__name__ == raw["architectures"][0]
    prompt = tokenizer("Describe what you see, then the rest")["input_ids"]
    run = run_engine(model, IdTokenizer(), [prompt], 8)
    expect = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert run.tokens["p0"] == expect


def _image_input(pixel_values, grid, i: int, tag: bytes):
    from xllm.proto.engine.v1 import engine_pb2

    return engine_pb2.ImageInput(pixel_values=_patches(pixel_values, grid, [i]).float().contiguous().numpy().tobytes(),
                                 grid_thw=grid[i].tolist(), content_hash=tag)


@pytest.mark.parametrize(("budget", "encode", "overlap"), [(512, 1, False), (24, 0, False), (24, 1, True)],
                         ids=["whole-encode-phase", "chunked-lazy", "chunked-encode-phase-async"])
@torch.inference_mode()
def test_images_through_the_engine_equal_hf(models, images, tokenizer, budget, encode, overlap):
    """Requests with one image, two images and none, in one batch through the engine (prefill whole, or in
    chunks of 24 tokens that split the images' token runs), greedy: each equals HF's greedy continuation with
    the same images; the encoder ran once per image: in the encode phase (batches of at most ``encode`` images),
    or, with the phase off, inside the prefill chunks (async scheduling: the encode on the forwards' thread);
    a repeat of a request reuses its KV (prefix cache) and
    equals it, a different image behind the same text does not take that KV and answers differently."""
    from xllm.core.config import EngineConfig
    from xllm.core.engine import LLMEngine
    from xllm.proto.engine.v1 import engine_pb2
    from xllm.testing.models import IdTokenizer

    hf, ours, _ = models
    pixel_values, grid = images
    cases = {"one": [0], "two": [1, 0], "none": []}
    engine = LLMEngine(ours, IdTokenizer(), EngineConfig(dtype=torch.float32, max_model_len=256, max_num_seqs=8,
                                                          num_threads=1, max_num_batched_tokens=budget, block_size=32,
                                                          max_encode_images=encode, async_scheduling=overlap))

    lead = torch.tensor(tokenizer("A long shared preamble, " * 8)["input_ids"])  # (two 32-token KV blocks)

    def prompt(which: list[int]) -> torch.Tensor:
        shown = grid[which] if which else torch.zeros(0, 3, dtype=torch.long)
        return torch.cat([lead, _prompt(tokenizer, ours, shown)])

    def request(rid: str, which: list[int], tags: dict[int, bytes]) -> engine_pb2.GenerateRequest:
        ids = prompt(which)
        return engine_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=ids.tolist(),
            images=[_image_input(pixel_values, grid, i, tags[i]) for i in which],
            sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))

    cached: dict[str, int] = {}

    def run(reqs: list[engine_pb2.GenerateRequest]) -> dict[str, list[int]]:
        for r in reqs:
            engine.add_request(r)
        got: dict[str, list[int]] = {}
        while engine.has_work():
            for c in engine.step():
                got.setdefault(c.request_id, []).extend(c.token_ids)
                if c.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                    cached[c.request_id] = c.usage.cached_prompt_tokens
        return got

    tags = {0: b"image-zero", 1: b"image-one"}
    got = run([request(name, which, tags) for name, which in cases.items()])
    for name, which in cases.items():
        ids = prompt(which)
        pv = _patches(pixel_values, grid, which) if which else None
        want = hf_greedy_with_images(hf, ids.tolist(), pv, grid[which] if which else None, ours.image_token_id, 6)
        assert got[name] == want, name
    cache = engine.runner.encoder_cache
    assert (cache.misses, cache.hits >= 1) == (2, True)  # image 0 served both requests (and, chunked, several chunks)
    # every image encoded in the encode phase, one per step (the bound); none there with the phase off
    assert (cache.phase_images, cache.phase_batches, cache.largest_batch) == ((2, 2, 1) if encode else (0, 0, 0))
    assert engine.runner.mode_steps["eager"] >= 1
    again = run([request("again", [0], tags)])
    assert again["again"] == got["one"] and cached["again"] > 0 and cached["one"] == 0
    # image 1's pixels under image 0's position: the same text and token count, other KV and another answer
    swapped = {0: b"image-one-as-zero"}
    other = engine_pb2.GenerateRequest(
        request_id="other", prompt_token_ids=request("x", [0], tags).prompt_token_ids,
        images=[engine_pb2.ImageInput(pixel_values=_image_input(pixel_values, grid, 0, b"").pixel_values[::-1],
                                      grid_thw=grid[0].tolist(), content_hash=swapped[0])],
        sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert run([other])["other"] != got["one"] and cached["other"] == 0


@torch.inference_mode()
def test_engine_refuses_bad_image_requests(models, images, tokenizer):
    from xllm.core.config import EngineConfig
    from xllm.core.engine import LLMEngine
    from xllm.engine_api.errors import InvalidRequestError
    from xllm.proto.engine.v1 import engine_pb2
    from xllm.testing.models import IdTokenizer

    _, ours, _ = models
    pixel_values, grid = images
    engine = LLMEngine(ours, IdTokenizer(), EngineConfig(dtype=torch.float32, max_model_len=256, num_threads=1))
    ids = _prompt(tokenizer, ours, grid[[0]]).tolist()
    good = _image_input(pixel_values, grid, 0, b"h")
    sampling = engine_pb2.SamplingParams(temperature=0, max_tokens=2)
    bad = {
        "without its image": ([], ids, "prompt_token_ids"),
        "short pixels": ([engine_pb2.ImageInput(pixel_values=good.pixel_values[:-4], grid_thw=good.grid_thw,
                                                content_hash=b"h")], ids, "images"),
        "no hash": ([engine_pb2.ImageInput(pixel_values=good.pixel_values, grid_thw=good.grid_thw)], ids, "images"),
        "too few tokens": ([good], [t for t in ids if t != ours.image_token_id][:10] + [ours.image_token_id] * 3,
                           "images"),
        "two images, one run": ([good, good], ids, "images"),
    }
    for why, (imgs, prompt, field) in bad.items():
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(engine_pb2.GenerateRequest(request_id=why, prompt_token_ids=prompt, images=imgs,
                                                          sampling=sampling))
        assert err.value.param == field, why
    assert not engine.has_work()
    speculating = LLMEngine(ours, IdTokenizer(), EngineConfig(dtype=torch.float32, max_model_len=256, num_threads=1,
                                                              speculative="ngram"))
    with pytest.raises(InvalidRequestError) as err:  # (images are not served with speculative decoding yet)
        speculating.add_request(engine_pb2.GenerateRequest(request_id="spec", prompt_token_ids=ids, images=[good],
                                                           sampling=sampling))
    assert err.value.param == "images" and not speculating.has_work()


def test_encode_batch_bound_comes_from_the_profile_under_a_tpot_target(models):
    """``--max-encode-images`` unset: with a TPOT target the bound is the profile's binary search over real encode
    times of 448x448 images (a generous target: up to the sequence slots; one no image meets: 1); without one,
    the default; a text model has no encode phase."""
    from xllm.core.config import EngineConfig
    from xllm.core.images import max_encode_images
    from xllm.sched.encode import DEFAULT_MAX_ENCODE_IMAGES

    _, ours, _ = models
    assert ours.reference_grid() == (1, 32, 32)  # 448 / 14 patches a side, whole 2x2 merge blocks
    config = EngineConfig(dtype=torch.float32, max_num_seqs=3)
    assert max_encode_images(config, ours) == DEFAULT_MAX_ENCODE_IMAGES
    assert max_encode_images(EngineConfig(max_encode_images=0), ours) == 0
    assert max_encode_images(EngineConfig(slo_tpot_ms=60_000, max_num_seqs=3), ours) == 3
    assert max_encode_images(EngineConfig(slo_tpot_ms=0.001, max_num_seqs=3), ours) == 1
    assert max_encode_images(EngineConfig(max_encode_images=2), object()) == 0


@torch.inference_mode()
def test_beam_search_with_an_image_equals_hf_generate(models, images, tokenizer):
    """A beam search over an image prompt (its beams' rows at the M-RoPE text positions after the image) equals HF
    ``generate(num_beams=3, num_return_sequences=3)`` with the same image: the same hypotheses in the same order and
    scores; a greedy request with the other image decodes in the same forwards and stays HF's."""
    from xllm.core.config import EngineConfig
    from xllm.core.engine import LLMEngine
    from xllm.proto.engine.v1 import engine_pb2
    from xllm.testing.models import IdTokenizer

    hf, ours, _ = models
    pixel_values, grid = images
    engine = LLMEngine(ours, IdTokenizer(), EngineConfig(dtype=torch.float32, max_model_len=256, max_num_seqs=4,
                                                          num_threads=1, block_size=32))
    prompts = {i: _prompt(tokenizer, ours, grid[[i]]).tolist() for i in (0, 1)}
    engine.add_request(engine_pb2.GenerateRequest(
        request_id="beams", prompt_token_ids=prompts[0], images=[_image_input(pixel_values, grid, 0, b"zero")],
        sampling=engine_pb2.SamplingParams(max_tokens=5, beam_width=3)))
    engine.add_request(engine_pb2.GenerateRequest(
        request_id="greedy", prompt_token_ids=prompts[1], images=[_image_input(pixel_values, grid, 1, b"one")],
        sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    beams, tokens, modes = None, [], dict(engine.runner.mode_steps)
    while engine.has_work():
        for c in engine.step():
            if c.request_id == "greedy":
                tokens += c.token_ids
            elif c.finish_reason:
                beams = c.beams
    x = torch.tensor([prompts[0]])  # (HF's M-RoPE positions need the token types: without them, text positions)
    out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=_patches(pixel_values, grid, [0]),
                      image_grid_thw=grid[[0]], mm_token_type_ids=(x == ours.image_token_id).int(), num_beams=3,
                      num_return_sequences=3, max_new_tokens=5, do_sample=False, output_scores=True,
                      return_dict_in_generate=True, temperature=None, top_p=None, top_k=None)
    assert [list(b.token_ids) for b in beams] == out.sequences[:, x.shape[1]:].tolist()
    assert [b.score for b in beams] == pytest.approx(out.sequences_scores.tolist(), abs=2e-3)
    assert tokens == hf_greedy_with_images(hf, prompts[1], _patches(pixel_values, grid, [1]), grid[[1]],
                                           ours.image_token_id, 5)
    assert engine.runner.mode_steps["beams"] > modes["beams"]  # the beams rode in the greedy request's forwards


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
@torch.inference_mode()
def test_an_image_request_resumed_elsewhere_continues_exactly(models, images, tokenizer, temperature):
    """What the gateway's failover sends another instance (:func:`xllm.gateway.progress.continuation`'s shape: the
    request with its images, its prompt plus the tokens the client has, marked as earlier output) finishes as the
    uninterrupted run did, token for token, greedy and seeded: the tokens after the image keep their M-RoPE
    positions and their sampling draws."""
    from xllm.core.config import EngineConfig
    from xllm.core.engine import LLMEngine
    from xllm.proto.engine.v1 import engine_pb2
    from xllm.testing.models import IdTokenizer

    _, ours, _ = models
    pixel_values, grid = images
    request = engine_pb2.GenerateRequest(
        request_id="r", prompt_token_ids=_prompt(tokenizer, ours, grid[[1]]).tolist(),
        images=[_image_input(pixel_values, grid, 1, b"one")],
        sampling=engine_pb2.SamplingParams(temperature=temperature, seed=7, max_tokens=8, ignore_eos=True))

    def run(req: engine_pb2.GenerateRequest) -> list[int]:
        engine = LLMEngine(ours, IdTokenizer(), EngineConfig(dtype=torch.float32, max_model_len=256,
                                                              num_threads=1, block_size=32))
        engine.add_request(req)
        out: list[int] = []
        while engine.has_work():
            for c in engine.step():
                out += c.token_ids
        engine.close()
        return out

    whole = run(request)
    cont = engine_pb2.GenerateRequest()
    cont.CopyFrom(request)
    cont.request_id = "r#1"
    cont.prompt_token_ids.extend(whole[:3])
    cont.resumed_output_tokens = 3
    assert len(whole) == 8 and run(cont) == whole[3:]
