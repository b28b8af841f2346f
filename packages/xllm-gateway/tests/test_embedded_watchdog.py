"""The step watchdog of ``xllm serve`` with its engine in this process (``--step-timeout``), on a tiny random
Llama: an engine thread deadlocked in a step (a :class:`StepGate` that never lets it return) is taken for hung.
The stream in flight ends with a 503 error event after the tokens it had, ``/health`` answers 503 naming the
hang, the gateway marks itself failed, and the HTTP server stops on its own (``xllm serve`` then exits with
status 1, :func:`xllm.gateway.http_guard.serve`)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from fastapi.testclient import TestClient

from xllm.core import EngineConfig
from xllm.gateway import embedded
from xllm.gateway.embedded import ServeOptions, build_embedded
from xllm.gateway.http_guard import HttpGuardOptions, build_server
from xllm.testing.engine import StepGate
from xllm.testing.models import save_tiny_llama

HOLD_AFTER = 4  # engine steps before the gate holds the engine thread
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    return save_tiny_llama(tmp_path_factory.mktemp("watchdog"), smollm2_dir)


def held_app(model_dir, monkeypatch, gate: StepGate, step_timeout: float):
    """``build_embedded`` of the tiny model with ``gate`` among its engine's step observers."""
    load = embedded.load_engine

    def load_held(*args, observers=None, **kwargs):
        return load(*args, observers=[*(observers or []), gate], **kwargs)

    monkeypatch.setattr(embedded, "load_engine", load_held)
    cfg = EngineConfig(dtype=torch.float32, kv_cache_memory_gib=0.05, max_model_len=256, max_num_seqs=4,
                       num_threads=1)
    return build_embedded(ServeOptions(model=str(model_dir), engine=cfg, progress=False, step_timeout=step_timeout))


def test_a_hung_engine_fails_its_stream_and_health_and_the_server_stops(model_dir, monkeypatch):
    gate = StepGate(hold_after=HOLD_AFTER)
    app = held_app(model_dir, monkeypatch, gate, step_timeout=1.0)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            assert client.get("/health").status_code == 200
            model = client.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "once upon a time", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                    "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
            tokens = [e for e in events if "choices" in e]
            assert tokens and len(tokens) < MAX_TOKENS  # some tokens, then the hang
            assert all(e["choices"][0]["finish_reason"] is None for e in tokens)
            assert events[-1]["error"]["type"] == "server_unavailable", events[-1]
            health = client.get("/health")
            assert health.status_code == 503
            (status,) = [i["status"] for i in health.json()["instances"].values()]
            assert status.startswith("engine hung"), status
            failure = app.state.gateway.failure
            assert failure is not None and failure.startswith("engine hung")
            late = client.post("/v1/completions", json={**body, "stream": False})
            assert late.status_code == 503 and late.json()["error"]["type"] == "server_unavailable"
    finally:
        gate.release()


def test_the_server_stops_once_its_stop_condition_holds():
    """What ``serve`` builds for a failed gateway: the uvicorn server returns from ``serve`` by itself."""
    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry

    failed: list[str] = []
    app = FastAPI()

    @app.get("/fail")
    def fail() -> dict:
        failed.append("failed")
        return {}

    server = build_server(app, "127.0.0.1", 0, HttpGuardOptions(), CollectorRegistry(), log_level="warning",
                          stop_when=lambda: bool(failed))

    async def main() -> None:
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /fail HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        await writer.drain()
        assert (await reader.read()).startswith(b"HTTP/1.1 200")
        writer.close()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())
    assert failed and server.should_exit is False  # (stopped by its condition, not told to exit)
