"""OpenAI sampling fields end to end: HTTP -> gateway -> the real engine on SmolLM2 (fp32) and back.

- logprobs: chat ``logprobs``/``top_logprobs`` and completions ``logprobs`` have the OpenAI shapes
  and their values are HF's ``log_softmax`` at each generated position (teacher forcing,
  ``|diff| < 1e-3``), streamed and not;
- ``n > 1``: each choice gets its own seed (``seed + i`` when seeded, independent otherwise), and a
  seeded choice equals the single-choice request with that seed even though it ran in a batch;
- stop strings spanning tokens and ``stop_token_ids``, ``ignore_eos`` with ``max_tokens``,
  ``min_tokens`` against a forced EOS;
- invalid combinations answer HTTP 400 with an OpenAI error body naming the parameter.
"""

from __future__ import annotations

import pytest
import torch

from xllm.core import EngineConfig
from xllm.gateway.embedded import ServeOptions, build_embedded
from xllm.testing.sse import sse_events

pytestmark = pytest.mark.real_model

LOGPROB_TOL = 1e-3
MSG = [{"role": "user", "content": "Name three colors of the rainbow."}]


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    cfg = EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.1, max_model_len=256, max_num_seqs=8, num_threads=1)
    app = build_embedded(ServeOptions(engine=cfg, progress=False))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def post(client, route: str, body: dict) -> dict:
    r = client.post(f"/v1/{route}", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@torch.inference_mode()
def hf_rows(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    return hf(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1:].float().log_softmax(-1)


def test_chat_logprobs_are_hf_log_softmax(client, smollm2_tokenizer, hf_smollm2_fp32):
    tok = smollm2_tokenizer
    body = {"messages": MSG, "temperature": 0, "max_tokens": 8, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 5}
    content = post(client, "chat/completions", body)["choices"][0]["logprobs"]["content"]
    assert len(content) == 8
    prompt = tok.apply_chat_template(MSG)
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode()) and len(entry["top_logprobs"]) == 5
    greedy = hf_greedy(hf_smollm2_fp32, prompt, 8)  # temperature 0 is HF's greedy path (tested elsewhere)
    rows = hf_rows(hf_smollm2_fp32, prompt, greedy)
    assert tok.token_strings(greedy) == [e["token"] for e in content]
    for j, entry in enumerate(content):
        assert abs(entry["logprob"] - float(rows[j, greedy[j]])) < LOGPROB_TOL
        vals, idx = rows[j].topk(5)
        assert [t["token"] for t in entry["top_logprobs"]] == tok.token_strings(idx.tolist())
        assert max(abs(t["logprob"] - float(v)) for t, v in zip(entry["top_logprobs"], vals)) < LOGPROB_TOL
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-6)
    # streaming carries the same entries, one per token
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    streamed = [e for ev in events[:-1] if ev["choices"] and ev["choices"][0]["logprobs"]
                for e in ev["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    # (the second request hits the prefix cache: a different but equivalent computation)
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(streamed, content)) < LOGPROB_TOL


def test_completion_logprobs_shape_and_values(client, smollm2_tokenizer, hf_smollm2_fp32):
    tok = smollm2_tokenizer
    prompt = "The three primary colors are"
    out = post(client, "completions", {"prompt": prompt, "temperature": 0, "max_tokens": 6, "ignore_eos": True,
                                       "logprobs": 3})
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(6)]
    ids = tok.encode(prompt)
    rows = hf_rows(hf_smollm2_fp32, ids, hf_greedy(hf_smollm2_fp32, ids, 6))
    for j in range(6):
        vals, idx = rows[j].topk(3)
        assert abs(lp["token_logprobs"][j] - float(vals[0])) < LOGPROB_TOL
        assert list(lp["top_logprobs"][j]) == tok.token_strings(idx.tolist())
        assert max(abs(a - float(b)) for a, b in zip(lp["top_logprobs"][j].values(), vals)) < LOGPROB_TOL
    # logprobs=0: the chosen token's logprob and no alternatives
    lp0 = post(client, "completions", {"prompt": prompt, "temperature": 0, "max_tokens": 2, "logprobs": 0,
                                       "ignore_eos": True})["choices"][0]["logprobs"]
    assert lp0["top_logprobs"] == [None, None] and len(lp0["token_logprobs"]) == 2


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def texts(body: dict) -> list[str]:
    return [c["message"]["content"] for c in body["choices"]]


def test_n_choices_get_distinct_seeds(client):
    base = {"messages": MSG, "temperature": 1.0, "max_tokens": 12, "ignore_eos": True}
    unseeded = texts(post(client, "chat/completions", {**base, "n": 4}))
    assert len(set(unseeded)) > 1  # every choice drew its own seed
    seeded = texts(post(client, "chat/completions", {**base, "n": 3, "seed": 100}))
    assert texts(post(client, "chat/completions", {**base, "n": 3, "seed": 100})) == seeded  # repeatable
    assert len(set(seeded)) == 3
    # choice i is the single request with seed 100 + i: batch neighbours do not change a seeded draw
    for i in range(3):
        assert texts(post(client, "chat/completions", {**base, "seed": 100 + i}))[0] == seeded[i]


def test_stop_strings_and_stop_token_ids(client, smollm2_tokenizer):
    tok = smollm2_tokenizer
    base = {"prompt": "The three primary colors are", "temperature": 0, "max_tokens": 16, "ignore_eos": True}
    full = post(client, "completions", base)["choices"][0]["text"]
    ids = tok.encode(full, add_special_tokens=False)
    a, b = tok.decode(ids[:3]), tok.decode(ids[:4])
    stop = a[-2:] + b[len(a):][:2]  # spans the boundary between tokens 3 and 4
    assert full.index(stop) < len(a) < full.index(stop) + len(stop)
    out = post(client, "completions", {**base, "stop": [stop, "never-there"]})["choices"][0]
    assert out["text"] == full[:full.index(stop)] and out["finish_reason"] == "stop"
    out = post(client, "completions", {**base, "stop": stop, "include_stop_str_in_output": True})["choices"][0]
    assert out["text"] == full[:full.index(stop) + len(stop)]
    body = post(client, "completions", {**base, "stop_token_ids": [ids[2]]})
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == tok.decode(ids[:2]) and body["usage"]["completion_tokens"] == 3


def test_ignore_eos_max_tokens_and_min_tokens(client, smollm2_tokenizer):
    eos = min(smollm2_tokenizer.eos_token_ids)
    forced = {"messages": MSG, "temperature": 0, "logit_bias": {str(eos): 100}, "max_tokens": 10}
    body = post(client, "chat/completions", forced)
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == ""
    body = post(client, "chat/completions", {**forced, "min_tokens": 4})
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "stop"
    body = post(client, "chat/completions", {**forced, "ignore_eos": True})
    assert body["usage"]["completion_tokens"] == 10 and body["choices"][0]["finish_reason"] == "length"


def test_temperature_zero_is_greedy_even_with_sampling_knobs(client):
    base = {"messages": MSG, "max_tokens": 10, "ignore_eos": True}
    greedy = texts(post(client, "chat/completions", {**base, "temperature": 0}))
    knobs = texts(post(client, "chat/completions", {**base, "temperature": 0, "top_p": 0.2, "top_k": 3, "min_p": 0.5,
                                                   "seed": 9, "n": 2}))
    assert knobs == greedy * 2


@pytest.mark.parametrize(("route", "body", "param"), [
    ("chat/completions", {"top_logprobs": 3}, None),                       # top_logprobs needs logprobs
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"best_of": 1, "n": 2}, None),                         # best_of below n
    ("completions", {"suffix": "x"}, None),
    ("chat/completions", {"stream_options": {"include_usage": True}}, None),  # without stream
    ("chat/completions", {"temperature": 2.5}, "temperature"),
    ("chat/completions", {"top_p": 0}, "top_p"),
    ("chat/completions", {"n": 0}, "n"),
    ("chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat/completions", {"top_k": -2}, "top_k"),
    ("chat/completions", {"min_p": 1.5}, "min_p"),
    ("chat/completions", {"seed": -1}, "seed"),
    ("chat/completions", {"stop": [""]}, "stop"),
    ("chat/completions", {"stop": [str(i) for i in range(17)]}, "stop"),
    ("chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    # checked by the engine against the model and context (same OpenAI error body)
    ("chat/completions", {"logit_bias": {"49152": 1}}, "logit_bias"),          # outside the vocabulary
    ("chat/completions", {"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
    ("completions", {"max_tokens": 300}, "max_tokens"),                        # beyond the context
])
def test_invalid_combinations_are_openai_400s(client, route, body, param):
    base = {"messages": MSG} if route.startswith("chat") else {"prompt": "Hello"}
    r = client.post(f"/v1/{route}", json={**base, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
