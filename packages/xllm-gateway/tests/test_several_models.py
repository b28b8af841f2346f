"""Two models behind one gateway (``xllm serve --model A --model B``, one engine each in this process): two
tiny Llamas with different weights and different chat templates. Each answers exactly as a one-model engine
of its own does (greedy, chat and completions, the prompt rendered by its own template), ``/v1/models``
lists both, ``/tokenize`` uses each model's template, and a model nobody serves is a 404."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from xllm.core import EngineConfig, LLMEngine
from xllm.gateway.embedded import ServeOptions, build_embedded
from xllm.models import Tokenizer, load_model
from xllm.testing.engine import generate, make_request
from xllm.testing.models import save_tiny_llama

# model B's chat template: not SmolLM2's (A keeps SmolLM2's), so a prompt rendered with the wrong one shows
TEMPLATE_B = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("two-models")
    a = save_tiny_llama(root / "a", smollm2_dir, seed=0)
    b = save_tiny_llama(root / "b", smollm2_dir, seed=1)
    (b / "chat_template.jinja").write_text(TEMPLATE_B)  # (where the tokenizer reads its template from)
    return {"a": a, "b": b}


def _config() -> EngineConfig:
    return EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, max_model_len=256, max_num_seqs=4,
                        num_threads=1)


@pytest.fixture(scope="module")
def gateway(model_dirs):
    app = build_embedded(ServeOptions(model=str(model_dirs["a"]), served_model_name="a", engine=_config(),
                                      progress=False, more_models=[(str(model_dirs["b"]), "b")]))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def _one_model(model_dir, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    """The oracle: a one-model engine of ``model_dir`` alone."""
    engine = LLMEngine(load_model(model_dir, torch.float32, progress=False), Tokenizer(model_dir), _config())
    try:
        got = generate(engine, [make_request("r", prompt, max_tokens=max_tokens, ignore_eos=True)])
        return got.tokens["r"], got.text["r"]
    finally:
        engine.close()


def test_each_model_answers_as_its_own_server(gateway, model_dirs):
    assert [m["id"] for m in gateway.get("/v1/models").json()["data"]] == ["a", "b"]
    answers = {}
    for name, model_dir in model_dirs.items():
        tok = Tokenizer(model_dir)
        prompt = tok.apply_chat_template(CHAT)
        want_tokens, want_text = _one_model(model_dir, prompt, 12)
        r = gateway.post("/v1/chat/completions", json={"model": name, "messages": CHAT, "temperature": 0,
                                                       "max_tokens": 12, "ignore_eos": True, "logprobs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == name and body["usage"]["prompt_tokens"] == len(prompt)
        assert body["choices"][0]["message"]["content"] == want_text
        got = [tok.encode(e["token"], add_special_tokens=False) for e in body["choices"][0]["logprobs"]["content"]]
        assert len(got) == len(want_tokens) == 12
        completion = gateway.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 12,
                                                           "temperature": 0, "ignore_eos": True}).json()
        assert completion["choices"][0]["text"] == want_text
        answers[name] = want_text
        counted = gateway.post("/tokenize", json={"model": name, "messages": CHAT}).json()
        assert counted["tokens"] == prompt
    assert answers["a"] != answers["b"]  # two models, two answers: neither served the other's request
    assert gateway.post("/tokenize", json={"model": "a", "messages": CHAT}).json()["tokens"] != \
        gateway.post("/tokenize", json={"model": "b", "messages": CHAT}).json()["tokens"]


def test_requests_without_a_model_go_to_the_first_and_unknown_ones_are_404(gateway):
    r = gateway.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "a"
    r = gateway.post("/v1/chat/completions", json={"model": "c", "messages": CHAT})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert gateway.post("/tokenize", json={"model": "c", "prompt": "x"}).status_code == 404
    metrics = gateway.get("/metrics").text  # per-model series
    assert 'model_name="a"' in metrics and 'model_name="b"' in metrics


def test_served_names_pair_with_models():
    from xllm.engine_api.flags import served_models
    from xllm.gateway.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "x", "--model", "y", "--served-model-name", "X",
                                      "--served-model-name", "Y"])
    assert served_models(args) == [("x", "X"), ("y", "Y")]
    assert served_models(build_parser().parse_args(["serve"])) == [(None, None)]
    with pytest.raises(ValueError, match="one per --model"):
        served_models(build_parser().parse_args(["serve", "--model", "x", "--model", "y", "--served-model-name",
                                                 "X"]))
