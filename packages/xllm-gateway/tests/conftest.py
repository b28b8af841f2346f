"""Fixtures of the gateway's tests: an app over a scripted engine client
(:class:`xllm.testing.fakes.FakeEngineClient`), so the gateway is tested without a model or a server process;
``etcd``, a real etcd server on loopback for the module (skipped where it cannot be installed)."""

from __future__ import annotations

import pytest

from xllm.gateway.app import GatewayState, create_app
from xllm.gateway.metrics import EngineMetrics
from xllm.gateway.registry import EmbeddedRegistry
from xllm.testing.fakes import FAKE_MAX_LEN, FAKE_MODEL, FakeEngineClient
from xllm.testing.processes import EtcdServer, ensure_etcd


@pytest.fixture(scope="session")
def fake_tokens(smollm2_tokenizer) -> list[int]:
    return smollm2_tokenizer.encode(" red green blue", add_special_tokens=False)


@pytest.fixture
def fake_engine(smollm2_tokenizer, fake_tokens) -> FakeEngineClient:
    return FakeEngineClient(smollm2_tokenizer, fake_tokens)


@pytest.fixture
def fake_state(fake_engine, smollm2_tokenizer) -> GatewayState:
    registry = EmbeddedRegistry()
    registry.register(fake_engine)
    return GatewayState(registry=registry, tokenizer=smollm2_tokenizer, metrics=EngineMetrics(),
                        default_model=FAKE_MODEL, max_model_len=FAKE_MAX_LEN)


@pytest.fixture
def fake_client(fake_state):
    from fastapi.testclient import TestClient

    with TestClient(create_app(fake_state), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    try:
        ensure_etcd()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server
    server.stop()
