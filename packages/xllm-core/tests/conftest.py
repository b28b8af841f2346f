"""Fixtures of xllm-core's tests. The helpers themselves (the tiny model and tokenizers, engine
drivers) are in :mod:`xllm.testing`; xllm-core must not depend on xllm-models, so its engine
tests run :class:`xllm.testing.tiny.TinyLM` (the real SmolLM2 parity tests live in xllm-models)."""

from __future__ import annotations

import functools

import pytest

from xllm.testing.engine import KV_BACKENDS, make_engine
from xllm.testing.engine import one_torch_thread as one_torch_thread
from xllm.testing.tiny import TinyLM


@pytest.fixture(params=KV_BACKENDS)
def kv_backend(request) -> str:
    """Run a test once per KV backend (engines from ``new_engine`` use it)."""
    return request.param


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def scheduling(request) -> bool:
    """Run a test with synchronous and with async (overlapped) scheduling (``new_engine`` uses it)."""
    return request.param


@pytest.fixture
def new_engine(request):
    """``new_engine(model=None, **config)``: :func:`xllm.testing.engine.make_engine` with the KV backend
    and scheduling mode this test is parametrized over (``kv_backend`` / ``scheduling``), if any."""
    names = request.fixturenames
    backend = request.getfixturevalue("kv_backend") if "kv_backend" in names else "xtensor"
    overlapped = request.getfixturevalue("scheduling") if "scheduling" in names else False
    return functools.partial(make_engine, kv_backend=backend, async_scheduling=overlapped)


@pytest.fixture(scope="session")
def tiny_model() -> TinyLM:
    return TinyLM()
