"""The API contract in ``/openapi.json`` (:mod:`xllm.gateway.openai.protocol_openapi`), and a
schema-driven fuzzer (schemathesis) against a live server.

- every POST route names its request body's schema, which accepts a known-good request and
  refuses what the server refuses (an unknown field, a refused feature, a bad ``logit_bias`` key,
  a value past this server's limits);
  the answers of the scripted engine validate against the published response schemas; ``/docs``
  is served; a method a route lacks is 405 with ``Allow``; with API keys the bearer scheme guards
  ``/v1/*`` (and only it);
- the fuzzer: a real uvicorn on a loopback port over an embedded engine with a tiny random Llama
  and an API key, every operation fed schema-valid and schema-violating cases (a fixed seed, a
  bounded number of each): no 5xx, every status and body as documented, every 4xx/5xx an
  OpenAI-style error, schema-violating bodies refused, the API key enforced.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import jsonschema
import numpy as np
import pytest
import torch

from xllm.gateway.access import KEYED_PREFIXES, AccessPolicy
from xllm.gateway.app import create_app
from xllm.gateway.metrics import EngineMetrics
from xllm.gateway.openai.limits import ApiLimits
from xllm.testing.processes import serving_in_thread
from xllm.testing.sse import sse_events

KEY = "sk-test-openapi"
WAIT = 60.0  # failure guard of the server's start and stop, never a timing assertion
EXAMPLES = 12  # cases per operation and generation mode (positive, negative)
POST_ROUTES = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
               "/v1/recommend": "RecommendRequest", "/v1/responses": "ResponsesRequest",
               "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest",
               "/v1/load_lora_adapter": "LoadLoraAdapterRequest", "/v1/unload_lora_adapter": "UnloadLoraAdapterRequest",
               "/v1/embeddings": "EmbeddingRequest", "/sleep": "SleepRequest", "/wake_up": "WakeUpRequest",
               "/update_weights": "UpdateWeightsRequest", "/update_weights_from_disk": "UpdateWeightsRequest"}
ADMIN_ROUTES = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter",  # the fuzzer's user key gets 403 there
                "/sleep", "/wake_up", "/update_weights", "/update_weights_from_disk"}
GOOD = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
                             "logit_bias": {"42": -5}, "stop": ["\n"], "stream": False, "audio": None},
    "/v1/completions": {"prompt": ["red", "green"], "max_tokens": 2, "logprobs": 1, "echo": True},
    "/v1/recommend": {"prompt": [1, 2, 3], "top_n": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 3, "temperature": 0, "store": False},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/load_lora_adapter": {"lora_name": "sql", "lora_path": "/nowhere"},  # (the fake engine refuses: 400)
    "/v1/unload_lora_adapter": {"lora_name": "sql"},  # (nobody serves it: 404)
    "/v1/embeddings": {"input": ["red", "green"], "encoding_format": "base64"},
    "/sleep": {"level": 1},  # (the fake engine neither sleeps nor updates weights: 400)
    "/wake_up": {},
    "/update_weights": {"model_path": "/nowhere"},
    "/update_weights_from_disk": {"model_path": "/nowhere"},
}
BAD = [  # (route, field, value): refused by the server and by the published schema
    ("/v1/chat/completions", "audio", {"voice": "x"}),
    ("/v1/chat/completions", "unknown_field", 1),
    ("/v1/chat/completions", "logit_bias", {"token": 1}),
    ("/v1/completions", "max_tokens", 0),
    ("/v1/completions", "n", ApiLimits().max_n + 1),  # this server's limit, published
    ("/v1/chat/completions", "stop", ["x"] * (ApiLimits().max_stop + 1)),
    ("/v1/recommend", "top_n", "3"),
    ("/v1/responses", "reasoning", {"effort": "high"}),
    ("/v1/responses", "max_output_tokens", 0),
    ("/tokenize", "unknown_field", 1),
    ("/detokenize", "tokens", [-1]),
    ("/v1/embeddings", "dimensions", 64),
]
ERROR_FIELDS = {"message", "type", "param", "code"}


def validator(doc: dict, schema: dict) -> jsonschema.Draft202012Validator:
    """A validator of ``schema`` (a part of ``doc``) resolving its ``#/components/...`` references."""
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def body_schema(doc: dict, path: str, status: str = "200", media: str = "application/json") -> dict:
    op = next(iter(doc["paths"][path].values()))
    return op["responses"][status]["content"][media]["schema"]


@pytest.fixture
def doc(fake_client) -> dict:
    r = fake_client.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def test_every_post_route_publishes_its_request_schema(doc, fake_client):
    assert set(POST_ROUTES) <= {p for p, ops in doc["paths"].items() if "post" in ops}
    for path, ops in doc["paths"].items():
        if "post" not in ops:
            continue
        schema = ops["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{POST_ROUTES[path]}"}, path
        check = validator(doc, schema)
        check.validate(GOOD[path])
        r = fake_client.post(path, json=GOOD[path])
        # the fake engine has no item catalogue (recommend may 400) and no adapters (load 400, unload 404)
        assert r.status_code in (200, 400, 404 if path == "/v1/unload_lora_adapter" else 400), r.text
    for path, field, value in BAD:
        body = {**GOOD[path], field: value}
        assert not validator(doc, {"$ref": f"#/components/schemas/{POST_ROUTES[path]}"}).is_valid(body), field
        r = fake_client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_answers_match_the_published_response_schemas(doc, fake_client):
    chat = fake_client.post("/v1/chat/completions", json={**GOOD["/v1/chat/completions"], "logprobs": True,
                                                           "top_logprobs": 2, "n": 2})
    validator(doc, body_schema(doc, "/v1/chat/completions")).validate(chat.json())
    completion = fake_client.post("/v1/completions", json={**GOOD["/v1/completions"], "prompt_logprobs": 1})
    validator(doc, body_schema(doc, "/v1/completions")).validate(completion.json())
    chunks = {"/v1/chat/completions": "ChatCompletionChunk", "/v1/completions": "CompletionChunk"}
    for path, chunk in chunks.items():
        sse = body_schema(doc, path, media="text/event-stream")  # one event: {"data": "[DONE]" or JSON}
        done, data = sse["properties"]["data"]["anyOf"]
        assert done == {"const": "[DONE]"} and data["contentMediaType"] == "application/json"
        assert {"$ref": f"#/components/schemas/{chunk}"} in data["contentSchema"]["anyOf"]
        r = fake_client.post(path, json={**GOOD[path], "stream": True, "stream_options": {"include_usage": True}})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and len(events) > 2
        for event in events[:-1]:
            validator(doc, data["contentSchema"]).validate(event)
    validator(doc, body_schema(doc, "/v1/models")).validate(fake_client.get("/v1/models").json())
    validator(doc, body_schema(doc, "/health")).validate(fake_client.get("/health").json())
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    error = fake_client.post("/v1/completions", json={"prompt": "x", "model": "nope"})
    assert error.status_code == 404
    validator(doc, body_schema(doc, "/v1/completions", "404")).validate(error.json())


def test_docs_are_served(fake_client):
    r = fake_client.get("/docs")
    assert r.status_code == 200 and "swagger" in r.text.lower() and "/openapi.json" in r.text


def test_a_method_a_route_lacks_is_405_with_allow(fake_client):
    r = fake_client.delete("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert set(r.json()["error"]) == ERROR_FIELDS


def test_bearer_scheme_guards_the_api_when_keys_are_set(fake_state, doc):
    from fastapi.testclient import TestClient

    assert "securitySchemes" not in doc["components"]
    assert all("security" not in op for ops in doc["paths"].values() for op in ops.values())
    keys = AccessPolicy(api_keys=frozenset({KEY}))
    keyed_state = dataclasses.replace(fake_state, metrics=EngineMetrics(), access=keys)
    with TestClient(create_app(keyed_state)) as client:
        keyed = client.get("/openapi.json").json()
    (name, scheme), = keyed["components"]["securitySchemes"].items()
    assert scheme["type"] == "http" and scheme["scheme"] == "bearer"
    for path, ops in keyed["paths"].items():
        for op in ops.values():
            if path.startswith(KEYED_PREFIXES):  # /v1/*, the page's data, /tokenize and /detokenize
                assert op["security"] == [{name: []}] and "401" in op["responses"], path
            else:
                assert "security" not in op, path  # /health and /metrics stay open
    assert {"/tokenize", "/detokenize", "/v1/responses"} <= set(keyed["paths"])


# --- the fuzzer, against a live server --------------------------------------------------------------

@pytest.fixture(scope="module")
def live_url(tmp_path_factory, smollm2_dir) -> Iterator[str]:
    """A real uvicorn on 127.0.0.1 (a free port) over an embedded tiny Llama with an item catalogue
    (for ``/v1/recommend``), API key :data:`KEY`."""
    import uvicorn

    from xllm.core import EngineConfig
    from xllm.gateway.embedded import ServeOptions, build_embedded
    from xllm.testing.models import save_tiny_llama

    root = tmp_path_factory.mktemp("openapi")
    np.save(root / "items.npy", np.random.default_rng(0).integers(100, 400, size=(50, 2)).astype(np.int32))
    model_dir = save_tiny_llama(root / "llama", smollm2_dir)
    cfg = EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, max_model_len=64, max_num_seqs=4,
                       num_threads=1, item_catalog=str(root / "items.npy"))
    app = build_embedded(ServeOptions(model=str(model_dir), engine=cfg, progress=False,
                                      limits=ApiLimits(max_n=4, max_prompts=4),
                                      access=AccessPolicy(api_keys=frozenset({KEY}))))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    with serving_in_thread(server, WAIT) as port:
        yield f"http://127.0.0.1:{port}"


def openai_error(ctx, response, case) -> None:
    """Every 4xx/5xx answer is ``{"error": {"message", "type", "param", "code"}}``."""
    if response.status_code < 400:
        return
    body = json.loads(response.content)
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)


def test_schemathesis_finds_no_5xx_and_only_openai_errors(live_url):
    import httpx
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        ignored_auth,
        negative_data_rejection,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
              response_schema_conformance, negative_data_rejection, ignored_auth, schemathesis.check(openai_error)]
    schema = schemathesis.openapi.from_dict(httpx.get(f"{live_url}/openapi.json").json())
    headers = {"Authorization": f"Bearer {KEY}"}
    seen: dict[str, set[int]] = {}  # operation -> the statuses it answered
    for result in schema.get_all_operations():
        operation = result.ok()
        # a route without a body or parameters has no schema-violating request
        for mode in list(GenerationMode) if len(operation.body) else [GenerationMode.POSITIVE]:
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case) -> None:
                response = case.call_and_validate(base_url=live_url, headers=headers, checks=checks, timeout=30)
                seen.setdefault(case.operation.label, set()).add(response.status_code)

            fuzz()
    assert set(seen) >= {f"POST {p}" for p in POST_ROUTES} | {"GET /v1/models", "GET /health", "GET /metrics"}
    for path in set(POST_ROUTES) - ADMIN_ROUTES:  # the generated bodies reached the engine, and the validation
        assert {200, 400} <= seen[f"POST {path}"], (path, seen)
