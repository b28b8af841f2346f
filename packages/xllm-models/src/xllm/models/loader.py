"""Load a HF safetensors model directory into our model classes, in file order.

RTP-LLM §4: iterate the shard files in order and each file's tensors in the
order their bytes lie on disk, reading through a memory map and copying (and
casting) each tensor straight into its parameter, so the page cache is read
sequentially and no second full copy of the weights is ever held.
"""

from __future__ import annotations

import json
import logging
import pathlib
import struct
import time
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from xllm.models.config import ModelConfig
from xllm.models.registry import model_class

log = logging.getLogger(__name__)


def shard_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    """The ``*.safetensors`` shards of ``model_dir``, in the order they should be read."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    return files


def tensor_names_in_file_order(path: pathlib.Path) -> list[str]:
    """Tensor names of one safetensors file sorted by their byte offset."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda n: header[n]["data_offsets"][0])


def iter_safetensors(files: list[pathlib.Path], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` over all shards in file order; tensors are mmap views."""
    plan = [(f, tensor_names_in_file_order(f)) for f in files]
    total = sum(len(names) for _, names in plan)
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False) as bar:
        for file, names in plan:
            with safe_open(str(file), framework="pt") as handle:
                for name in names:
                    yield name, handle.get_tensor(name)
                    bar.update(1)


def load_model(model_dir: str | pathlib.Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", progress: bool = True) -> torch.nn.Module:
    """Build the model class for ``model_dir``'s architecture and load its weights.

    Parameters are allocated directly in ``dtype`` on ``device`` (no random
    init), then filled in file order. Returns the model in eval mode.
    """
    model_dir = pathlib.Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    cls = model_class(cfg.architecture)
    start = time.perf_counter()
    with torch.device("meta"):
        model = cls(cfg).to(dtype)
    model = model.to_empty(device=device)
    model.load_weights(iter_safetensors(shard_files(model_dir), progress))
    model.post_load()
    model.eval().requires_grad_(False)
    log.info("loaded %s (%s) from %s in %.2fs", cfg.architecture, dtype, model_dir, time.perf_counter() - start)
    return model
