"""Chat completions with an image over an embedded tiny random LLaVA (CLIP tower, projector, Llama): the gateway
runs the model's fixed-size (CLIP) image processor, cuts its pixels into the tower's patches and expands the
template's ``<image>`` token to one token per patch; the answer equals HF transformers' greedy continuation with
HF's own processor output."""

from __future__ import annotations

import base64
import io
import json

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from xllm.core import EngineConfig
from xllm.gateway.embedded import ServeOptions, build_embedded
from xllm.testing.models import save_random_vl

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}"
            "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@torch.inference_mode()
def test_image_chat_over_llava_equals_hf(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer, LlavaConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = TEMPLATE
    image_id = tok.convert_tokens_to_ids("<image>")
    cfg = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                           num_attention_heads=2, image_size=56, patch_size=14, projection_dim=32),
        image_token_id=image_id, image_seq_length=16)
    hf = save_random_vl(cfg, tmp_path)
    tok.save_pretrained(tmp_path)
    processor = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    processor.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())  # the text fields at the top too (the loader's layout)
    (tmp_path / "config.json").write_text(json.dumps({**raw, **raw["text_config"],
                                                      "architectures": raw["architectures"]}))
    g = torch.Generator().manual_seed(2)
    pixels = torch.randint(0, 256, (70, 90, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    PIL.fromarray(pixels).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    app = build_embedded(ServeOptions(model=str(tmp_path), served_model_name="llava", progress=False,
                                      engine=EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05,
                                                          max_model_len=256, num_threads=1, block_size=32)))
    with TestClient(app, raise_server_exceptions=False) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        got = client.chat.completions.create(
            model="llava", max_tokens=5, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is this? "},
                                                   {"type": "image_url", "image_url": {"url": url}}]}])
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "What is this? "},
                                                                 {"type": "image"}]}],
                                   tokenize=False, add_generation_prompt=True)
    ids = []
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        ids.extend([image_id] * 16 if t == image_id else [t])
    pv = torch.from_numpy(processor(images=[PIL.open(io.BytesIO(buf.getvalue())).convert("RGB")],
                                    return_tensors="np")["pixel_values"])
    want: list[int] = []
    for _ in range(5):
        want.append(int(hf(input_ids=torch.tensor([ids + want]), pixel_values=pv).logits[0, -1].argmax()))
    assert got.choices[0].message.content == tok.decode(want)
    assert got.usage.prompt_tokens == len(ids)
