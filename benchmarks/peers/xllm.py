"""The project itself: ``xllm serve`` as a server peer, and :class:`xllm.core.LLMEngine` offline.

It runs from the harness's own interpreter (the venv that has the xllm packages installed).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import pathlib
import sys

from benchmarks.peers.venv import ServerProcess, free_port

NAME = "xLLM"
WORKER = pathlib.Path(__file__).resolve().parent.parent / "workers" / "xllm_offline.py"


def python() -> str:
    return sys.executable


def versions() -> dict[str, str]:
    out = {}
    for dist in ("xllm-gateway", "xllm-core", "xllm-models", "torch", "transformers"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    from benchmarks.machine import git_commit

    out["git"] = git_commit(str(pathlib.Path(__file__).resolve().parents[2])) or "?"
    return out


def server(model_dir: pathlib.Path, dtype: str, threads: int, log_dir: pathlib.Path,
           max_num_seqs: int = 64, extra_args: list[str] | None = None) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "xllm.gateway", "serve", "--model", str(model_dir), "--port", str(port),
           "--dtype", dtype, "--threads", str(threads), "--max-num-seqs", str(max_num_seqs), "--no-progress",
           "--log-level", "warning", *(extra_args or [])]
    return ServerProcess(NAME, cmd, port, log_dir / f"xllm-{dtype}.log", health_path="/health")
