"""``/v1/embeddings`` through the official ``openai`` client over an embedded tiny Llama: each input's pooled final
hidden state equals HF transformers' (the last layer's normed hidden state at the last token, or the mean over
the input; unit norm), for text and token-id inputs, as floats and as base64; bad inputs are 400s naming the
field, and nothing of it touches the KV cache."""

from __future__ import annotations

import base64
import struct

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from xllm.core import EngineConfig
from xllm.gateway.embedded import ServeOptions, build_embedded
from xllm.models import Tokenizer
from xllm.testing.models import save_tiny_llama

transformers = pytest.importorskip("transformers")
TEXTS = ["The library opens at nine.", "Where is the reading room?"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_dir):
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("embed") / "tiny", smollm2_dir)
    cfg = EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, max_model_len=64, num_threads=1)
    app = build_embedded(ServeOptions(model=str(model_dir), served_model_name="tiny", engine=cfg, progress=False))
    with TestClient(app, raise_server_exceptions=False) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        yield model_dir, http, client, app


@torch.inference_mode()
def _hf(model_dir, ids: list[int], pooling: str) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(pooled, dim=0)


def test_embeddings_equal_hf_pooled_hidden_states(served):
    model_dir, _, client, app = served
    tok = Tokenizer(model_dir)
    got = client.embeddings.create(model="tiny", input=TEXTS)
    assert got.model == "tiny" and [d.index for d in got.data] == [0, 1]
    ids = [tok.encode(t) for t in TEXTS]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    for d, prompt in zip(got.data, ids, strict=True):
        torch.testing.assert_close(torch.tensor(d.embedding), _hf(model_dir, prompt, "last"), atol=1e-4, rtol=1e-4)
    mean = client.embeddings.create(model="tiny", input=ids[1], extra_body={"pooling": "mean"})
    torch.testing.assert_close(torch.tensor(mean.data[0].embedding), _hf(model_dir, ids[1], "mean"), atol=1e-4,
                               rtol=1e-4)
    (engine,) = app.state.gateway.registry.instances()
    assert engine.engine.load_report().kv_usage == 0  # no KV taken, nothing cached


def test_base64_and_refusals(served):
    _, http, _, _ = served
    floats = http.post("/v1/embeddings", json={"input": TEXTS[0]}).json()["data"][0]["embedding"]
    packed = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(floats, abs=1e-6)
    for body, param in (({"input": "x", "dimensions": 8}, "dimensions"), ({"input": [[]]}, "input"),
                        ({"input": "word " * 100}, "input"), ({"input": [10**8]}, "input"),
                        ({"input": "x", "pooling": "max"}, "pooling")):
        r = http.post("/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert http.post("/v1/embeddings", json={"input": "x", "model": "other"}).status_code == 404
