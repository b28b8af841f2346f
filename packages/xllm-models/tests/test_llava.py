"""LLaVA (:mod:`xllm.models.llava`: CLIP tower, projector, Llama) against HF transformers on a tiny random model
saved by HF: the image features, and greedy tokens through the engine with one and two images (and none) equal
HF's full-forward greedy continuation; the architecture loads through the engine's loader."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

IMAGE = 299  # the image token (the last id of the tiny vocabulary)


@pytest.fixture(scope="module")
def models(tmp_path_factory, one_torch_thread):
    from transformers import LlavaConfig

    from xllm.models.llava import load_llava
    from xllm.testing.models import save_random_vl

    cfg = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                           num_attention_heads=2, image_size=56, patch_size=14, projection_dim=32),
        image_token_id=IMAGE, image_seq_length=16)
    path = tmp_path_factory.mktemp("llava")
    hf = save_random_vl(cfg, path)
    return hf, load_llava(path, torch.float32), path


@pytest.fixture(scope="module")
def pixels():
    g = torch.Generator().manual_seed(4)
    return torch.randn(2, 3, 56, 56, generator=g)


@torch.inference_mode()
def test_image_features_match_hf(models, pixels):
    from xllm.models.llava import patch_rows

    hf, ours, _ = models
    want = hf.model.get_image_features(pixel_values=pixels)
    want = getattr(want, "pooler_output", want)  # (transformers 5: an output object; its features per image)
    want = torch.stack(list(want)) if isinstance(want, (list, tuple)) else want
    got = torch.stack(ours.encode_images(patch_rows(pixels, 14), torch.tensor([[1, 4, 4]] * 2)))
    torch.testing.assert_close(got, want.reshape(got.shape), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="4x4 patches only"):
        ours.encode_images(patch_rows(pixels[:1, :, :28, :28], 14), torch.tensor([[1, 2, 2]]))


@pytest.mark.parametrize("which", [[0], [1, 0], []], ids=["one", "two", "none"])
@torch.inference_mode()
def test_greedy_through_the_engine_equals_hf(models, pixels, which):
    from xllm.core.config import EngineConfig
    from xllm.core.engine import LLMEngine
    from xllm.models.llava import patch_rows
    from xllm.proto.engine.v1 import engine_pb2
    from xllm.testing.models import IdTokenizer

    hf, ours, _ = models
    ids = [5, 17, 42]
    for i in which:
        ids += [IMAGE] * 16 + [60 + i, 61]
    ids += [7, 8]
    engine = LLMEngine(ours, IdTokenizer(), EngineConfig(dtype=torch.float32, max_model_len=256, num_threads=1,
                                                          block_size=32, max_num_batched_tokens=24))
    engine.add_request(engine_pb2.GenerateRequest(
        request_id="r", prompt_token_ids=ids, sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=6,
                                                                                 ignore_eos=True),
        images=[engine_pb2.ImageInput(pixel_values=patch_rows(pixels[i:i + 1], 14).numpy().tobytes(),
                                      grid_thw=[1, 4, 4], content_hash=f"img{i}".encode()) for i in which]))
    got: list[int] = []
    while engine.has_work():
        for c in engine.step():
            got += c.token_ids
    want: list[int] = []
    for _ in range(6):
        x = torch.tensor([ids + want])
        kw = {"pixel_values": pixels[which]} if which else {}
        want.append(int(hf(input_ids=x, **kw).logits[0, -1].argmax()))
    assert got == want
    engine.close()


def test_the_loader_takes_the_architecture(models, tmp_path):
    import json
    import shutil

    from xllm.models import load_model

    _, _, path = models
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    raw = json.loads((path / "config.json").read_text())  # the text fields at the top too, as the loader reads them
    (tmp_path / "config.json").write_text(json.dumps({**raw, **raw["text_config"],
                                                      "architectures": raw["architectures"]}))
    model = load_model(tmp_path, torch.float32, progress=False)
    assert type(model).__name__ == "LlavaForConditionalGeneration" and model.image_token_id == IMAGE
