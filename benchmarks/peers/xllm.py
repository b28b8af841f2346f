"""The project itself: ``xllm serve`` as a server peer, and :class:`xllm.core.LLMEngine` offline.

It runs from the harness's own interpreter (the venv that has the xllm packages installed).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import pathlib
import sys
import time

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


def model_dir(arg: str | None, progress: bool = False) -> pathlib.Path:
    """``--model`` of a benchmark: the given dir, else the bundled SmolLM2 (converted once, cached)."""
    if arg:
        return pathlib.Path(arg)
    from xllm.models import resolve_model

    return resolve_model(progress=progress)


def wait_instances(base_url: str, n: int, timeout: float = 600.0) -> None:
    """Wait until the gateway at ``base_url`` lists ``n`` healthy engine instances."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            body = httpx.get(base_url + "/health", timeout=5, trust_env=False).json()
            if sum(1 for v in body.get("instances", {}).values() if v["healthy"]) >= n:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{n} instances not healthy after {timeout:.0f} s")
