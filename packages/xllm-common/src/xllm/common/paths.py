"""Where xLLM keeps files it builds once and reuses: converted models, compiled native kernels,
Inductor graphs, benchmark venvs. One root, ``$XLLM_CACHE_DIR`` (default ``~/.cache/xllm``)."""

from __future__ import annotations

import os
import pathlib

CACHE_ENV = "XLLM_CACHE_DIR"


def cache_dir(*parts: str) -> pathlib.Path:
    """The cache root, or ``parts`` below it (not created here)."""
    env = os.environ.get(CACHE_ENV)
    root = pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "xllm"
    return root.joinpath(*parts)
