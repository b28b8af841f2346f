"""Two models behind one cluster gateway: ``xllm serve --model A --model B --instances 1`` starts one engine
process per model (``engine-0`` serves A, ``m1-engine-0`` B); each model's requests go to its own engine and
answer exactly as a one-model engine of that model does (greedy), each prompt tokenized with its own model's
tokenizer at the front."""

from __future__ import annotations

import httpx
import pytest
import torch

from xllm.core import EngineConfig, LLMEngine
from xllm.models import Tokenizer, load_model
from xllm.testing.engine import generate, make_request
from xllm.testing.models import save_tiny_llama
from xllm.testing.processes import healthy_instances, wait_for

PROMPT = "The library opens at nine and closes at"


@pytest.fixture(scope="module")
def two(tmp_path_factory, smollm2_dir, launch_server, tiny_engine_flags):
    root = tmp_path_factory.mktemp("cluster-models")
    dirs = {name: save_tiny_llama(root / name, smollm2_dir, seed=seed) for name, seed in (("a", 0), ("b", 1))}
    gw = launch_server("--model", str(dirs["a"]), "--served-model-name", "a", "--model", str(dirs["b"]),
                       "--served-model-name", "b", "--instances", "1", *tiny_engine_flags)
    try:
        wait_for(lambda: healthy_instances(gw.url) == {"engine-0", "m1-engine-0"}, 120, "both engines up")
        yield gw, dirs
    finally:
        gw.stop()


def test_each_model_is_served_by_its_own_engine_as_a_one_model_engine_would(two):
    gw, dirs = two
    listed = httpx.get(f"{gw.url}/v1/models", timeout=10, trust_env=False).json()["data"]
    assert [m["id"] for m in listed] == ["a", "b"]
    texts = {}
    for name, engine_id in (("a", "engine-0"), ("b", "m1-engine-0")):
        prompt = Tokenizer(dirs[name]).encode(PROMPT)
        oracle = LLMEngine(load_model(dirs[name], torch.float32, progress=False), Tokenizer(dirs[name]),
                           EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, num_threads=1))
        try:
            want = generate(oracle, [make_request("r", prompt, max_tokens=16, ignore_eos=True)]).text["r"]
        finally:
            oracle.close()
        r = httpx.post(f"{gw.url}/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 16,
                                                         "temperature": 0, "ignore_eos": True},
                       timeout=60, trust_env=False)
        assert r.status_code == 200, r.text
        assert r.headers["x-xllm-instance"] == engine_id and r.json()["choices"][0]["text"] == want
        texts[name] = want
    assert texts["a"] != texts["b"]
