"""Fixtures of xllm-models' tests (helpers: :mod:`xllm.testing.models`)."""

from __future__ import annotations

from xllm.testing.engine import one_torch_thread as one_torch_thread

