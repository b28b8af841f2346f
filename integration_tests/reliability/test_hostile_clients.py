"""Hostile and careless clients against a real gateway: one embedded server (a tiny random-weight
model) behind uvicorn on a loopback port, configured through the ``xllm serve`` flags (an API key,
a priority key, a 1 MiB body limit, a 20,000-character prompt limit).

- 78 malformed or abusive requests (lone surrogates anywhere, non-finite numbers, unknown and
  unsupported fields, every limit, broken JSON; the table is ``xllm.testing.hostile``, shared with
  ``python -m benchmarks reliability``): each gets a 4xx with an OpenAI error body naming
  the field, and ``/health`` answers 200 after each; a valid request still works at the end;
- the body limit: a declared ``Content-Length`` past it is refused before any body byte is sent,
  a chunked body as soon as it passes it (the rest is never sent: a server waiting for it would
  never answer);
- the API key (401 without or with a wrong one, ``/health`` and ``/metrics`` open) and priority
  gating (403 for a plain key, honoured for the priority key);
- templating off the event loop: ``/health`` answers while the chat template is blocked inside a call.

The server runs in this process (so a test can block its tokenizer): uvicorn on a thread of its own.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from xllm.testing.hostile import CASES, CHAT, COMPLETIONS, MODEL, PROMPT_CHARS, chat, completion
from xllm.testing.processes import serving_in_thread

pytestmark = pytest.mark.real_model  # the tiny model carries SmolLM2's tokenizer

USER_KEY = "sk-test-user-0123456789"
PRIO_KEY = "sk-test-priority-0123456789"
BODY_LIMIT = 1024 * 1024
WAIT = 60.0  # failure guard of waits on events, never a timing assertion


@dataclass
class Served:
    url: str
    port: int
    app: object


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[Served]:
    import uvicorn

    from xllm.gateway.api_flags import access_policy, api_limits
    from xllm.gateway.cli import build_parser
    from xllm.gateway.embedded import build_embedded, serve_options

    args = build_parser().parse_args([
        "serve", "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--no-progress",
        "--dtype", "float32", "--kv-cache-memory", "0.05", "--threads", "1", "--max-num-seqs", "8",
        "--max-model-len", "512", "--api-key", USER_KEY, "--priority-api-key", PRIO_KEY,
        "--max-body-mib", str(BODY_LIMIT / 2**20), "--max-prompt-chars", str(PROMPT_CHARS)])
    app = build_embedded(serve_options(args, limits=api_limits(args), access=access_policy(args, environ={})))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    with serving_in_thread(server, WAIT) as port:
        yield Served(f"http://127.0.0.1:{port}", port, app)


@pytest.fixture(scope="module")
def http(served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=WAIT, trust_env=False,
                      headers={"Authorization": f"Bearer {USER_KEY}"}) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None, type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    assert (err["type"], err["param"]) == (type_, param), err
    return err


# the case table is shared with `python -m benchmarks reliability` (xllm.testing.hostile)
HOSTILE = [pytest.param(c.path, c.body, c.status, c.param, c.type_, id=c.name) for c in CASES]


def send(http: httpx.Client, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()  # ASCII escapes
    return http.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "body", "status", "param", "type_"), HOSTILE)
def test_hostile_request_is_a_named_4xx_and_the_server_keeps_serving(served, http, path, body, status, param, type_):
    assert_error(send(http, path, body), status, param, type_)
    health = httpx.get(f"{served.url}/health", timeout=WAIT, trust_env=False)
    assert health.status_code == 200, health.text


def test_there_are_at_least_sixty_hostile_cases():
    assert len(HOSTILE) >= 60


@pytest.mark.parametrize(("path", "body"), [
    (CHAT, chat(store=False, metadata={"team": "qa"}, parallel_tool_calls=True, response_format={"type": "text"},
                tool_choice="auto", service_tier="default", prompt_cache_key="k", safety_identifier="u-1",
                user="u", seed=1, temperature=1e-45, reasoning_effort=None, audio=None)),
    (CHAT, chat(tool_choice="none", modalities=["text"], stream=True,
                stream_options={"include_usage": True, "include_obfuscation": False})),
    (COMPLETIONS, completion(temperature=1e-45, response_format={"type": "text"}, echo=True, best_of=1, suffix="",
                             stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})),
])
def test_harmless_fields_are_accepted(http, path, body):
    r = send(http, path, {**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        assert r.json()["usage"]["completion_tokens"] == 2  # a tiny temperature samples normally


def test_a_valid_request_still_works_after_all_that(http):
    r = http.post(CHAT, json=chat(max_tokens=4, temperature=0, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    r = http.post(COMPLETIONS, json=completion(prompt=["a", "b"], n=2, max_tokens=3, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4


# ---- the body limit, over raw HTTP ---------------------------------------------------------------


def exchange(port: int, head: bytes, parts: Iterable[bytes] = ()) -> tuple[int, bytes]:
    """Send ``head`` and ``parts`` on one connection, then read one response: (status, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
        s.sendall(head)
        for part in parts:
            s.sendall(part)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, f"connection closed before a response: {data!r}"
            data += chunk
        head_bytes, _, body = data.partition(b"\r\n\r\n")
        lines = head_bytes.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
        while len(body) < int(headers.get("content-length", 0)):
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        return int(lines[0].split()[1]), body


def request_head(extra: str) -> bytes:
    return (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {USER_KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


def test_declared_body_past_the_limit_is_refused_before_it_is_sent(served):
    status, body = exchange(served.port, request_head(f"Content-Length: {100 * BODY_LIMIT}\r\n"))
    assert status == 413
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_chunked_body_is_refused_once_it_passes_the_limit(served):
    chunk = b" " * 65536
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (BODY_LIMIT // len(chunk)) + [b"1\r\n \r\n"]  # limit + 1 byte
    status, body = exchange(served.port, request_head("Transfer-Encoding: chunked\r\n"), parts)  # never terminated
    assert status == 413
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_body_at_the_limit_is_served(http):
    body = json.dumps(completion(max_tokens=1)).encode()
    r = http.post(COMPLETIONS, content=body + b" " * (BODY_LIMIT - len(body)),
                  headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


# ---- keys and priority ----------------------------------------------------------------------------


def test_api_key(served):
    with httpx.Client(base_url=served.url, timeout=WAIT, trust_env=False) as anonymous:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": USER_KEY}):
            err = assert_error(anonymous.post(CHAT, json=chat(), headers=headers), 401, None, "authentication_error")
            assert err["code"] == "invalid_api_key"
        assert_error(anonymous.get("/v1/models"), 401, None, "authentication_error")
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/metrics").status_code == 200
        for key in (USER_KEY, PRIO_KEY):
            r = anonymous.post(CHAT, json=chat(), headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"].startswith("req_")


@pytest.mark.parametrize("fields", [{"priority": -10}, {"priority": -1}, {"service_tier": "priority"},
                                    {"service_tier": "scale"}])  # flex / positive priority: a downgrade, free
def test_priority_is_honoured_for_the_priority_key_only(served, http, fields):
    assert http.post(CHAT, json=chat(**fields)).status_code == 403
    r = http.post(CHAT, json=chat(**fields), headers={"Authorization": f"Bearer {PRIO_KEY}"})
    assert r.status_code == 200, r.text


# ---- work off the event loop ----------------------------------------------------------------------


def test_health_answers_while_the_chat_template_is_blocked(served, http, monkeypatch):
    """The chat template runs on the preprocessing threads: with it blocked inside a call, /health
    and another request that needs no template (a token-id completion) are still served."""
    tokenizer = served.app.state.gateway.tokenizer
    real = tokenizer.apply_chat_template
    entered, release = threading.Event(), threading.Event()

    def blocked(*args, **kwargs):
        entered.set()
        assert release.wait(WAIT)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", blocked)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(http.post, CHAT, json=chat(max_tokens=2, ignore_eos=True))
        try:
            assert entered.wait(WAIT), "the chat request never reached the template"
            assert httpx.get(f"{served.url}/health", timeout=WAIT, trust_env=False).status_code == 200
            r = http.post(COMPLETIONS, json=completion(prompt=[1, 2, 3], max_tokens=2, ignore_eos=True))
            assert r.status_code == 200, r.text
            assert not pending.done()
        finally:
            release.set()
        r = pending.result(WAIT)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
