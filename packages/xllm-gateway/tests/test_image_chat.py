"""Chat completions with images over an embedded tiny random Qwen2-VL (``image_url`` parts as ``data:`` URLs),
through the official ``openai`` client: the answer equals HF transformers' greedy continuation of the same
conversation with the same image (HF's own image processor and the template's one image token per image,
expanded to the image's tokens); an image sent twice answers the same and reuses its KV; a text model, a
broken image and image tokens typed into the text are 400s naming the field. The Responses API's ``input_image``
parts take the same path."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from xllm.core import EngineConfig
from xllm.gateway.embedded import ServeOptions, build_embedded
from xllm.testing.metrics import metric_value, parse_metrics
from xllm.testing.models import (
    VISION_TOKENS,
    flatten_vl_config,
    hf_greedy_with_images,
    save_random_vl,
    tiny_qwen_vl_config,
)
from xllm.testing.vl_case import QWEN_VL_CHAT_TEMPLATE

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")
TEMPLATE = QWEN_VL_CHAT_TEMPLATE


def _png(seed: int, size=(56, 84)) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    PIL.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = tmp_path_factory.mktemp("qwen2vl")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    hf = save_random_vl(tiny_qwen_vl_config("qwen2_vl", len(tok), ids), path)
    tok.save_pretrained(path)
    processor = Qwen2VLImageProcessorPil()
    processor.save_pretrained(path)
    flatten_vl_config(path, path)  # the text fields at the top, as the loader reads them
    cfg = EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, max_model_len=256, num_threads=1,
                       block_size=32)
    app = build_embedded(ServeOptions(model=str(path), served_model_name="vl", engine=cfg, progress=False))
    with TestClient(app, raise_server_exceptions=False) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        yield hf, tok, processor, client, http


@torch.inference_mode()
def _hf_answer(hf, tok, processor, messages: list[dict], png: bytes, n: int) -> list[int]:
    """HF's greedy tokens: the template rendered by HF's tokenizer, its image token expanded to the image's
    tokens, HF's processor on the image, full forwards with HF's own M-RoPE."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image = processor(images=[PIL.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")
    grid = image["image_grid_thw"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids = []
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        ids.extend([pad] * int(grid.prod() // 4) if t == pad else [t])
    return hf_greedy_with_images(hf, ids, image["pixel_values"], grid, pad, n)


def _image_counts(http) -> tuple[float, float, float]:
    samples = parse_metrics(http.get("/metrics").text)
    return tuple(metric_value(samples, name, missing_ok=True) for name in (
        "xllm:images_encoded_total", "xllm:image_encoder_cache_hits_total", "xllm:image_encode_seconds_total"))


def test_image_chat_equals_hf(served):
    """A chat with an image answers as HF does; asked again, it answers the same from the cached KV; another image
    behind the same text gets none of that KV; ``/metrics`` counts the two images encoded and the one found in
    the encoder cache."""
    hf, tok, processor, client, http = served
    before = _image_counts(http)
    png = _png(1)
    lead = "Please look carefully at the picture below before you answer. " * 3  # (a full 32-token KV block)
    question = [{"type": "text", "text": lead + "What is in this picture? "},
                {"type": "image_url", "image_url": {"url": _url(png)}}, {"type": "text", "text": " Tell me."}]
    got = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": question}], max_tokens=6,
                                         temperature=0, extra_body={"ignore_eos": True})
    hf_messages = [{"role": "user", "content": [{"type": "text", "text": lead + "What is in this picture? "},
                                                {"type": "image"}, {"type": "text", "text": " Tell me."}]}]
    want = tok.decode(_hf_answer(hf, tok, processor, hf_messages, png, 6))
    assert got.choices[0].message.content == want
    again = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": question}], max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == want
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    other = [question[0], {"type": "image_url", "image_url": {"url": _url(_png(2))}}, question[2]]
    third = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": other}], max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert third.usage.prompt_tokens_details.cached_tokens == 0  # another image: none of that KV
    assert third.choices[0].message.content != want
    encoded, hits, seconds = (a - b for a, b in zip(_image_counts(http), before, strict=True))
    assert encoded == 2 and hits >= 1 and seconds > 0


def test_image_in_responses_equals_hf(served):
    """``input_image`` parts of the Responses API reach the same image path: the answer is HF's greedy one, and a
    follow-up turn (``previous_response_id``) reuses the image's KV."""
    hf, tok, processor, client, _ = served
    png = _png(4)
    lead = "Describe the picture that follows in a few words, please. " * 3
    got = client.responses.create(model="vl", max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": lead},
                                     {"type": "input_image", "image_url": _url(png), "detail": "auto"}]}])
    hf_messages = [{"role": "user", "content": [{"type": "text", "text": lead}, {"type": "image"}]}]
    want = _hf_answer(hf, tok, processor, hf_messages, png, 6)
    if tok.eos_token_id in want:  # (no ignore_eos in the Responses API: the answer stops at EOS)
        want = want[:want.index(tok.eos_token_id)]
    assert got.output_text == tok.decode(want)
    follow = client.responses.create(model="vl", max_output_tokens=2, temperature=0, previous_response_id=got.id,
                                     input="And the colours?")
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the first turn's image KV, reused


@torch.inference_mode()
def test_beam_search_over_an_image_equals_hf(served):
    """``use_beam_search`` with an image: the choices are HF ``generate(num_beams=3)``'s hypotheses, best first."""
    hf, tok, processor, client, _ = served
    png = _png(5)
    content = [{"type": "text", "text": "Name this picture: "}, {"type": "image_url", "image_url": {"url": _url(png)}}]
    got = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": content}], max_tokens=4,
                                         n=3, extra_body={"use_beam_search": True})
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "Name this picture: "},
                                                                 {"type": "image"}]}],
                                   tokenize=False, add_generation_prompt=True)
    image = processor(images=[PIL.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids = []
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        ids.extend([pad] * int(image["image_grid_thw"].prod() // 4) if t == pad else [t])
    x = torch.tensor([ids])
    out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=image["pixel_values"],
                      image_grid_thw=image["image_grid_thw"], mm_token_type_ids=(x == pad).int(), num_beams=3,
                      num_return_sequences=3, max_new_tokens=4, do_sample=False, temperature=None, top_p=None,
                      top_k=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    want = [tok.decode([t for t in row if t != tok.eos_token_id]) for row in out[:, x.shape[1]:].tolist()]
    assert [c.message.content for c in got.choices] == want


def test_bad_images_are_400s_naming_the_field(served):
    _, _, _, _, http = served
    cases = [
        ([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
         "messages[0].content[1].image_url.url"),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
         "messages[0].content[0].image_url.url"),
        ([{"type": "text", "text": "typed <|image_pad|> token"}, {"type": "image_url", "image_url": {
            "url": _url(_png(3))}}], "messages"),
    ]
    for content, field in cases:
        r = http.post("/v1/chat/completions", json={"model": "vl", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field, r.json()
    for content in ([{"type": "input_image", "file_id": "file-1"}],  # no files API
                    [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]):  # a broken image
        r = http.post("/v1/responses", json={"model": "vl", "max_output_tokens": 2,
                                             "input": [{"role": "user", "content": content}]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith("input"), r.json()
    assert http.get("/health").status_code == 200
