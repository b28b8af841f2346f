"""llama.cpp through llama-cpp-python: built from source in its own venv, served batch-1.

Its Python server serialises requests behind a global lock, so it is a batch-1 speed reference,
not a concurrency peer. The same SmolLM2 weights are turned into a BF16 or F32 GGUF with the
``convert_hf_to_gguf.py`` shipped inside the llama-cpp-python sdist (vendor/llama.cpp).
"""

from __future__ import annotations

import hashlib
import pathlib
import tarfile

from benchmarks.client import EndpointProfile
from benchmarks.peers.venv import TORCH, PeerVenv, ServerProcess, cache_root, free_port

NAME = "llama.cpp"
HERE_WORKERS = pathlib.Path(__file__).resolve().parents[1] / "workers"
VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32"}


def venv() -> PeerVenv:
    return PeerVenv("llamacpp")


def _steps(sdist_dir: pathlib.Path) -> list[list[str]]:
    return [
        ["install", TORCH],
        ["download", "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", str(sdist_dir)],
        ["install", f"{sdist_dir / SDIST}[server]"],
        # what the vendored convert_hf_to_gguf.py needs (it imports the vendored gguf-py itself)
        ["install", "transformers", "sentencepiece", "safetensors", "numpy", "pyyaml", "tqdm"],
    ]


def install(log: pathlib.Path | None = None) -> PeerVenv:
    """Build llama-cpp-python from source (~5 min on 2 cores) unless already done."""
    v = venv()
    v.ensure(_steps(v.path / "sdist"), env={"CMAKE_BUILD_PARALLEL_LEVEL": "2"}, log=log)
    return v


def versions() -> dict[str, str]:
    return venv().versions(["llama_cpp_python", "torch", "transformers"])


def _converter(v: PeerVenv) -> pathlib.Path:
    src = v.path / "sdist" / "src"
    script = src / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    if not (script.parent / "conversion" / "__init__.py").is_file():
        # the converter script, its ``conversion`` package and the matching ``gguf-py``
        src.mkdir(parents=True, exist_ok=True)
        wanted = ("/vendor/llama.cpp/convert_hf_to_gguf.py", "/vendor/llama.cpp/conversion/",
                  "/vendor/llama.cpp/gguf-py/")
        with tarfile.open(v.path / "sdist" / SDIST) as tar:
            members = [m for m in tar.getmembers() if any(w in m.name for w in wanted)]
            tar.extractall(src, members=members, filter="data")
    return script


def _key(model_dir: pathlib.Path) -> str:
    """Short hash of the model dir's path, config and weight file sizes (a changed model gets a new GGUF)."""
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    h.update((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:10]


def gguf_for(model_dir: pathlib.Path, dtype: str, log: pathlib.Path | None = None) -> pathlib.Path:
    """A GGUF of ``model_dir`` in ``dtype`` (bfloat16 -> BF16, float32 -> F32), converted once."""
    if dtype not in GGUF_TYPES:
        raise ValueError(f"llama.cpp peer supports {sorted(GGUF_TYPES)}, not {dtype}")
    out = cache_root() / "gguf" / f"{model_dir.name}-{_key(model_dir)}-{GGUF_TYPES[dtype]}.gguf"
    if out.is_file():
        return out
    v = install()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    log = log or out.with_suffix(".log")
    with open(log, "w") as f:
        v.run([str(_converter(v)), str(model_dir), "--outtype", GGUF_TYPES[dtype], "--outfile", str(tmp)],
              stdout=f, stderr=f)
    tmp.rename(out)
    return out


def profile(model_dir: pathlib.Path | None = None) -> EndpointProfile:
    """llama-cpp-python's server takes text prompts only (the prompts are round-trip-stable, so it sees the
    same tokens), has no ``ignore_eos`` but honours ``min_tokens``, sends no usage when streaming, and drops
    connections when streams overlap (its global lock), so it gets one request at a time."""
    return EndpointProfile(token_ids=False, extra_body={}, include_usage=False, min_tokens=True, max_concurrency=1)


def amx_breaks_quantized() -> bool:
    """Whether llama.cpp's extra buffer types must stay off for quantized GGUFs here: on a CPU that
    advertises AMX, ggml's AMX matmul of quantized weights dies with SIGILL (``benchmarks/workers/
    llamacpp_server.py``)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_int8" in text.split()


def quantized_server_command(python: str, gguf: pathlib.Path, port: int, threads: int, alias: str) -> list[str]:
    """The server command for a quantized GGUF: through the worker that turns the extra buffer types off
    where :func:`amx_breaks_quantized`."""
    flags = ["--no-extra-bufts"] if amx_breaks_quantized() else []
    return [python, str(HERE_WORKERS / "llamacpp_server.py"), *flags, "--model", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048",
            "--model_alias", alias]


def server(model_dir: pathlib.Path, dtype: str, threads: int, log_dir: pathlib.Path) -> ServerProcess:
    """The llama-cpp-python OpenAI server on a free loopback port (not started yet)."""
    v = install()
    gguf = gguf_for(model_dir, dtype)
    port = free_port()
    cmd = [v.python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048",
           "--model_alias", model_dir.name]
    return ServerProcess(NAME, cmd, port, log_dir / f"llamacpp-{dtype}.log")
