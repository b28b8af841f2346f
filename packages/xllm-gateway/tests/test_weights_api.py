"""Sleep, wake and weight updates through the HTTP API (``POST /sleep``, ``/wake_up``, ``GET /is_sleeping``,
``POST /update_weights``; :mod:`xllm.gateway.openai.serving_weights`): a tiny random Llama A served in this
process, updated in place to B (same shapes, another seed). Oracle: HF transformers' greedy text on A or B.
Streams that are running when the update is posted finish on A (the update drains them first), requests
after it answer as HF on B; while asleep a request gets a clear 503; bad input is a 400 naming the field and
leaves A serving; only an admin key may change anything (403)."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from xllm.core import EngineConfig
from xllm.gateway.access import AccessPolicy
from xllm.gateway.embedded import ServeOptions, build_embedded
from xllm.testing.models import save_tiny_llama

transformers = pytest.importorskip("transformers")

PROMPT = [1, 504, 9087, 314, 28, 4031, 3110, 1004, 42, 711]
LONG = [1] + [(37 * i + 11) % 40000 + 100 for i in range(150)]  # several KV blocks: cached under A first
NEW = 8
ADMIN = {"Authorization": "Bearer sk-admin"}
USER = {"Authorization": "Bearer sk-user"}


@torch.inference_mode()
def _hf_text(model_dir, prompt, tokenizer_dir) -> str:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    return tok.decode(out[0, len(prompt):].tolist(), skip_special_tokens=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("weights-api")
    a, b = save_tiny_llama(root / "a", smollm2_dir, seed=1), save_tiny_llama(root / "b", smollm2_dir, seed=2)
    bad = root / "bad"
    bad.mkdir()
    tensors = load_file(str(b / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1].contiguous()
    save_file(tensors, str(bad / "model.safetensors"))
    oracle = {(w, p): _hf_text(d, list(p), a) for w, d in (("a", a), ("b", b)) for p in (tuple(PROMPT), tuple(LONG))}
    cfg = EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, max_model_len=512, max_num_seqs=8,
                       num_threads=1)
    access = AccessPolicy(api_keys=frozenset({"sk-user"}), admin_keys=frozenset({"sk-admin"}))
    app = build_embedded(ServeOptions(model=str(a), served_model_name="tiny", engine=cfg, progress=False,
                                      access=access))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, {"a": a, "b": b, "bad": bad}, oracle


def _complete(client, prompt, headers=USER):
    return client.post("/v1/completions", headers=headers, json={"model": "tiny", "prompt": list(prompt),
                                                                  "max_tokens": NEW, "temperature": 0,
                                                                  "ignore_eos": True})


def _text(client, prompt) -> str:
    r = _complete(client, prompt)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _to(client, dirs, which: str) -> None:
    client.post("/wake_up", headers=ADMIN)
    r = client.post("/update_weights", headers=ADMIN, json={"model_path": str(dirs[which])})
    assert r.status_code == 200, r.text


def _stream_after_first_chunk(client, prompt, started: threading.Event, out: list) -> None:
    """Stream a completion; ``started`` is set once its first token arrived (it runs in the engine)."""
    body = {"model": "tiny", "prompt": list(prompt), "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = []
    with client.stream("POST", "/v1/completions", headers=USER, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
                started.set()
    out.append("".join(text))
    started.set()


def test_update_while_streams_run_then_answers_equal_hf_on_b(served):
    client, dirs, oracle = served
    _to(client, dirs, "a")
    assert _text(client, LONG) == oracle["a", tuple(LONG)]  # LONG's blocks cached under A
    outs: list[list[str]] = [[], [], []]
    events = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=_stream_after_first_chunk, args=(client, p, e, o))
               for p, e, o in zip((PROMPT, LONG, PROMPT), events, outs, strict=True)]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(60)
    r = client.post("/update_weights", headers=ADMIN, json={"model_path": str(dirs["b"])})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    for t in threads:
        t.join(60)
    assert [o[0] for o in outs] == [oracle["a", tuple(PROMPT)], oracle["a", tuple(LONG)], oracle["a", tuple(PROMPT)]]
    assert _text(client, PROMPT) == oracle["b", tuple(PROMPT)]
    assert _text(client, LONG) == oracle["b", tuple(LONG)]  # A's cached prefix is never served for B
    assert oracle["a", tuple(LONG)] != oracle["b", tuple(LONG)]
    r = client.post("/update_weights_from_disk", headers=ADMIN, json={"model_path": str(dirs["a"])})  # SGLang's
    assert r.status_code == 200, r.text
    assert _text(client, LONG) == oracle["a", tuple(LONG)]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_refuses_with_503_and_wake_answers_as_before(served, level):
    client, dirs, oracle = served
    _to(client, dirs, "a")
    assert client.get("/is_sleeping", headers=USER).json()["is_sleeping"] is False
    r = client.post(f"/sleep?level={level}", headers=ADMIN)
    assert r.status_code == 200, r.text
    assert client.get("/is_sleeping", headers=USER).json()["is_sleeping"] is True
    r = _complete(client, PROMPT)
    assert r.status_code == 503
    assert "sleeping" in r.json()["error"]["message"] and "/wake_up" in r.json()["error"]["message"]
    assert client.post("/sleep", headers=ADMIN, json={"level": 1}).status_code == 200  # asleep: nothing to do
    assert client.post("/wake_up", headers=ADMIN).status_code == 200
    assert client.post("/wake_up", headers=ADMIN).status_code == 200  # awake: nothing to do
    assert client.get("/is_sleeping", headers=USER).json()["is_sleeping"] is False
    assert _text(client, PROMPT) == oracle["a", tuple(PROMPT)]
    assert _text(client, LONG) == oracle["a", tuple(LONG)]


def test_bad_input_is_a_400_naming_it_and_a_keeps_serving(served, tmp_path):
    client, dirs, oracle = served
    _to(client, dirs, "a")
    for body, param, words in (({"model_path": str(tmp_path / "nope")}, "model_path", "not a directory"),
                               ({"model_path": str(tmp_path)}, "model_path", "no *.safetensors"),
                               ({"model_path": str(dirs["bad"])}, "model_path", "model.layers.0.mlp.up_proj.weight"),
                               ({}, "model_path", ""),
                               ({"model_path": str(dirs["b"]), "load_format": "pt"}, "load_format", "safetensors")):
        r = client.post("/update_weights", headers=ADMIN, json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.text
    for path, kwargs in (("/sleep?level=3", {}), ("/sleep", {"json": {"level": 0}})):
        r = client.post(path, headers=ADMIN, **kwargs)
        assert r.status_code == 400 and r.json()["error"]["param"] == "level", r.text
    assert _text(client, PROMPT) == oracle["a", tuple(PROMPT)]


def test_only_an_admin_key_may_sleep_wake_or_update(served):
    client, dirs, oracle = served
    _to(client, dirs, "a")
    for path, body in (("/sleep", None), ("/wake_up", None), ("/update_weights", {"model_path": str(dirs["b"])}),
                       ("/update_weights_from_disk", {"model_path": str(dirs["b"])})):
        r = client.post(path, headers=USER, json=body)
        assert r.status_code == 403, (path, r.text)
        assert client.post(path, json=body).status_code == 401  # no key at all
    assert _text(client, PROMPT) == oracle["a", tuple(PROMPT)]
