"""Reading a safetensors directory into a loaded model in place: the weight reader of engine sleep (level 2)
and weight updates (:mod:`xllm.core.engine_weights`).

The loader's own name mapping does the copying (the model's ``load_weights``: fused shards, casting,
completeness). Before anything is written, the directory is checked against the model: it exists, holds
``*.safetensors``, and every tensor named like a parameter has that parameter's shape; a mismatch only the
mapping sees (a fused shard of the wrong size, a missing or unexpected tensor) is found while copying, and then
the previous directory's weights are read back, so a refused update leaves the old weights serving.
"""

from __future__ import annotations

import json
import pathlib
import struct

import torch

from xllm.engine_api.errors import InvalidRequestError
from xllm.models.loader import iter_safetensors, shard_files
from xllm.models.weights import WeightLoadError

_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


def _headers(files: list[pathlib.Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor's ``(dtype, shape)`` from the files' headers (no tensor data is read)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error) as exc:
            raise InvalidRequestError(f"{f.name} is not a readable safetensors file ({exc})", "model_path") from None
        header.pop("__metadata__", None)
        for name, meta in header.items():
            out[name] = (str(meta.get("dtype")), tuple(meta.get("shape", ())))
    return out


def check_checkpoint(model: torch.nn.Module, directory: str | pathlib.Path) -> list[pathlib.Path]:
    """The shard files of ``directory`` once its tensors fit ``model`` as far as their headers tell:
    ``InvalidRequestError`` (``param`` ``model_path``) for a directory that is not there, holds no
    ``*.safetensors``, a tensor that is not floating point, or one named like a parameter with another shape."""
    path = pathlib.Path(directory)
    if not path.is_dir():
        raise InvalidRequestError(f"model_path {str(directory)!r} is not a directory", "model_path")
    try:
        files = shard_files(path)
    except FileNotFoundError:
        raise InvalidRequestError(f"model_path {str(directory)!r} holds no *.safetensors weights",
                                  "model_path") from None
    params = dict(model.named_parameters())
    for name, (dtype, shape) in _headers(files).items():
        if dtype not in _FLOAT_DTYPES:
            raise InvalidRequestError(f"tensor {name} is {dtype}: weight updates take floating-point safetensors "
                                      "only", "model_path")
        param = params.get(name)
        if param is not None and tuple(param.shape) != shape:
            raise InvalidRequestError(f"tensor {name} has shape {list(shape)}, the model's parameter "
                                      f"{list(param.shape)}", "model_path")
    return files


@torch.no_grad()
def read_weights(model: torch.nn.Module, directory: str, fallback: str | None) -> None:
    """Copy ``directory``'s weights into ``model`` in place (:class:`xllm.core.engine_weights.WeightReader`).
    Checked first (:func:`check_checkpoint`); a mismatch found while copying reads ``fallback``'s weights back
    (when given) and raises ``InvalidRequestError`` naming the tensor. The caller refreshes what the model
    derives from its weights (packed copies, the fused forward)."""
    files = check_checkpoint(model, directory)
    try:
        model.load_weights(iter_safetensors(files, progress=False))  # type: ignore[operator]
    except (WeightLoadError, ValueError) as exc:
        if fallback is not None:
            model.load_weights(iter_safetensors(shard_files(pathlib.Path(fallback)), progress=False))  # type: ignore[operator]
        raise InvalidRequestError(f"model_path {directory!r} does not fit the model: {exc}", "model_path") from None
