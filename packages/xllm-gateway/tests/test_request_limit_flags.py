"""The request limits are one set of flags for the gateway and its engines (issue 50, item 2): ``xllm serve``
with ``--max-stop``/``--max-stop-chars``/``--max-prompt-chars`` raised lets a request past the defaults
through end to end (the gateway's 400 and the engine's own check both follow the flags); with the defaults
the same request is refused, naming the field. The engine alone refusing past its configured limit is
``xllm-core``'s ``test_an_engine_configured_with_other_bounds_applies_them``; the flags reaching spawned
engines, ``test_cli``'s ``test_request_limit_flags_reach_the_api_limits_the_engine_config_and_spawned_engines``.
"""

from __future__ import annotations

import pytest

from xllm.engine_api.bounds import MAX_STOP, MAX_STOP_CHARS
from xllm.gateway.api_flags import api_limits
from xllm.gateway.cli import build_parser
from xllm.gateway.embedded import build_embedded, serve_options
from xllm.testing.models import save_tiny_llama

STOPS = ["\u2603" * (MAX_STOP_CHARS + 44)] * (MAX_STOP + 4)  # past both default bounds; never in the output
RAISED = ["--max-stop", str(MAX_STOP * 2), "--max-stop-chars", str(MAX_STOP_CHARS * 2)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    return save_tiny_llama(tmp_path_factory.mktemp("limits") / "llama", smollm2_dir)


def serve(model_dir, *flags: str):
    """A test client of ``xllm serve``'s single-process app built from these flags, as the CLI builds it."""
    from fastapi.testclient import TestClient

    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--dtype", "fp32", "--max-model-len", "64",
                                      "--kv-cache-memory", "0.05", "--max-num-seqs", "2", "--threads", "1",
                                      "--kv-cache-backend", "paged", "--no-progress", *flags])
    return TestClient(build_embedded(serve_options(args, limits=api_limits(args))), raise_server_exceptions=False)


def complete(client, **body):
    model = client.get("/v1/models").json()["data"][0]["id"]
    return client.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3, "temperature": 0,
                                                **body})


def test_raised_limits_let_a_bigger_stop_list_through_end_to_end(model_dir):
    with serve(model_dir, *RAISED) as client:
        passed = complete(client, stop=STOPS)
        past = complete(client, stop=STOPS * 2)  # past the raised count: still refused
    with serve(model_dir) as client:
        refused = complete(client, stop=STOPS)
    assert passed.status_code == 200, passed.text
    assert passed.json()["choices"][0]["finish_reason"] == "length"
    for answer in (past, refused):
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "stop", answer.text
