"""Packages whose public names are imported on first access (PEP 562).

A package that re-exports torch-backed classes would import torch as soon as anything imports
one of its torch-free submodules (Python runs the package ``__init__`` first). With
:func:`lazy_exports` the ``__init__`` names its exports without importing them, so
``import xllm.core.sampling_params`` stays torch-free while ``from xllm.core import LLMEngine`` works.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps each public name to the
    submodule (relative to ``package``) that defines it. A name is imported once, then cached in
    the package's namespace."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
