"""One tiny random Qwen2-VL image case shared by the engine's and the gateway's multimodal hand-off tests: our
model, a prompt holding one image's tokens, two images on the same grid (so their prompts are equal) and HF
transformers' greedy continuation of the prompt with each (the oracle)."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import torch

from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.models import VISION_TOKENS, hf_greedy_with_images, save_random_vl, tiny_qwen_vl_config

# Qwen2-VL's chat layout in a few lines: one <|image_pad|> per image part, which the gateway expands to the image's
# tokens (for SmolLM2's tokenizer with the vision tokens added, as these random models use)
QWEN_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass(frozen=True)
class VLCase:
    """``model``: ours (float32); ``prompt``: a shared preamble, the image's tokens, a question; ``a`` / ``b``:
    the two images (content hashes ``b"A"`` / ``b"B"``); ``want[hash]``: HF's ``new_tokens`` greedy tokens."""

    model: object
    prompt: list[int]
    a: engine_pb2.ImageInput
    b: engine_pb2.ImageInput
    want: dict[bytes, list[int]]


def vl_case(tokenizer_dir: pathlib.Path, path: pathlib.Path, new_tokens: int) -> VLCase:
    """Save a tiny random Qwen2-VL in ``path`` (SmolLM2's tokenizer from ``tokenizer_dir`` with the vision tokens
    added) and build the case (needs transformers and PIL)."""
    import PIL.Image
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from xllm.models.qwen_vl import load_qwen_vl

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    hf = save_random_vl(tiny_qwen_vl_config("qwen2_vl", len(tok), ids), path)
    ours = load_qwen_vl(path, torch.float32)
    g = torch.Generator().manual_seed(5)
    pic = PIL.Image.fromarray(torch.randint(0, 256, (84, 56, 3), generator=g, dtype=torch.uint8).numpy())
    out = Qwen2VLImageProcessorPil()(images=[pic], return_tensors="pt")
    pixels, grid = out["pixel_values"].float().contiguous(), out["image_grid_thw"]
    run = [ids["<|vision_start|>"]] + [ours.image_token_id] * int(grid.prod() // 4) + [ids["<|vision_end|>"]]
    prompt = tok("A long shared preamble, " * 8)["input_ids"] + run + tok(" What is it?")["input_ids"]

    def image(values: torch.Tensor, tag: bytes) -> engine_pb2.ImageInput:
        return engine_pb2.ImageInput(pixel_values=values.numpy().tobytes(), grid_thw=grid[0].tolist(),
                                     content_hash=tag)

    other = pixels.flip(0).contiguous()
    with torch.inference_mode():
        want = {tag: hf_greedy_with_images(hf, prompt, values, grid, ours.image_token_id, new_tokens)
                for tag, values in ((b"A", pixels), (b"B", other))}
    assert want[b"A"] != want[b"B"]  # (the image matters)
    return VLCase(ours, prompt, image(pixels, b"A"), image(other, b"B"), want)
