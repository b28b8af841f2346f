"""Beam search through the OpenAI routes (``use_beam_search``) and ``POST /v1/recommend`` over an
item catalogue, on an embedded engine with a tiny random Llama (SmolLM2's vocabulary)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.gateway.embedded import ServeOptions, build_embedded
from xllm.models import load_model
from xllm.models.tokenizer import Tokenizer
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import generate
from xllm.testing.models import save_tiny_llama

ITEMS = np.random.default_rng(3).integers(100, 400, size=(300, 3)).astype(np.int32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("beam")
    np.save(root / "items.npy", ITEMS)
    return save_tiny_llama(root / "llama", smollm2_dir)


def engine_config(model_dir) -> EngineConfig:
    """The served engine's settings (the beam oracle builds its engine with the same)."""
    return EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, max_model_len=256, max_num_seqs=4,
                        num_threads=1, item_catalog=str(model_dir.parent / "items.npy"))


@pytest.fixture(scope="module")
def client(model_dir):
    from fastapi.testclient import TestClient

    app = build_embedded(ServeOptions(model=str(model_dir), engine=engine_config(model_dir), progress=False))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_recommend_returns_catalogue_items_best_first(client):
    r = client.post("/v1/recommend", json={"prompt": "user 17 watched 3 films", "top_n": 5, "beam_width": 16})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "recommendation" and len(out["items"]) == 5
    logprobs = [it["logprob"] for it in out["items"]]
    assert logprobs == sorted(logprobs, reverse=True) and all(lp < 0 for lp in logprobs)
    for it in out["items"]:
        assert it["token_ids"] == ITEMS[it["item_id"]].tolist()
    # chat messages as the history; a wider beam never finds a worse best item
    r = client.post("/v1/recommend", json={"messages": [{"role": "user", "content": "history: a b c"}],
                                           "top_n": 3, "top_k": 8})
    assert r.status_code == 200, r.text and len(r.json()["items"]) == 3
    wide = client.post("/v1/recommend", json={"prompt": "user 17 watched 3 films", "top_n": 5,
                                              "beam_width": 64}).json()
    assert wide["items"][0]["logprob"] >= out["items"][0]["logprob"] - 1e-5


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "top_n": 8, "beam_width": 4}, "beam_width"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, None),
    ({"prompt": "x", "top_n": 0}, "top_n"),
])
def test_recommend_refuses_bad_requests(client, body, param):
    r = client.post("/v1/recommend", json=body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert param in (r.json()["error"]["param"] or r.json()["error"]["message"])


def test_completions_and_chat_beam_search(client):
    body = {"prompt": "The", "max_tokens": 6, "use_beam_search": True, "n": 2, "best_of": 4,
            "length_penalty": 0.5, "early_stopping": "never"}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == 2 and all(c["text"] for c in out["choices"])
    assert out["choices"][0]["text"] != out["choices"][1]["text"]
    again = client.post("/v1/completions", json=body).json()  # deterministic
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in out["choices"]]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "n": 3,
                                                  "use_beam_search": True, "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    metrics = client.get("/metrics").text
    assert "xllm:beam_steps_total" in metrics and "xllm:beam_candidates_scanned_total" in metrics


def test_beam_choices_are_the_engines_best_hypotheses_best_first(client, model_dir):
    """The choices are the top ``n`` of the engine's own finished beams, in non-increasing score (the
    oracle: an engine over the same weights, searched directly; the answer carries no scores)."""
    prompt = [504, 3458, 282, 4649, 314]
    width, n, max_tokens = 6, 3, 6
    reference = LLMEngine(load_model(model_dir, torch.float32, progress=False), Tokenizer(model_dir),
                          engine_config(model_dir))
    sampling = engine_pb2.SamplingParams(max_tokens=max_tokens, beam_width=width, length_penalty=0.5,
                                         early_stopping="never")
    beams = generate(reference, [engine_pb2.GenerateRequest(request_id="ref", prompt_token_ids=prompt,
                                                             sampling=sampling)]).final["ref"].beams
    reference.close()
    assert len(beams) == width
    ranked = sorted(beams, key=lambda h: -h.score)
    assert [h.score for h in ranked[:n]] > [h.score for h in ranked[-n:]]  # the best and the worst differ
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "use_beam_search": True,
                                             "n": n, "best_of": width, "length_penalty": 0.5,
                                             "early_stopping": "never"})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == [h.text for h in ranked[:n]]
    assert [c["finish_reason"] for c in choices] == ["length"] * n
    assert r.json()["usage"]["completion_tokens"] == sum(len(h.token_ids) for h in ranked[:n])


@pytest.mark.parametrize("extra,param", [
    ({"stream": True}, "stream"), ({"temperature": 0.8}, "temperature"), ({"logprobs": 2}, "logprobs"),
    ({"stop": ["x"]}, "stop"), ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
    ({"use_beam_search": False, "early_stopping": True}, "early_stopping"),
])
def test_bad_beam_combinations_are_refused(client, extra, param):
    body = {"prompt": "The", "max_tokens": 4, "use_beam_search": True, **extra}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
