"""The engine over real model architectures: every test here builds an engine (or an embedded app) over a
model of xllm-models (SmolLM2's real weights or tiny random configs of the other architectures) and holds
the whole serving path to its oracle, HF ``transformers``. They carry the ``engine`` marker
(``pytest -m engine`` / ``-m "not engine"``); the tests beside this folder check the models alone
(configs, loading, tokenizers, placement), without an engine."""

from __future__ import annotations

import pathlib

import pytest

HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in pathlib.Path(item.path).parents:
            item.add_marker(pytest.mark.engine)
