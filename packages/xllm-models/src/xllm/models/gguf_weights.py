"""A GGUF file's weights as stored: quantized tensors stay quantized (no dequantization of the file).

:func:`read_gguf_weights` maps every tensor of a llama-architecture GGUF to its HF name
(:func:`xllm.models.gguf_import.hf_tensor_name`): ``Q8_0``/``Q4_0``/``Q4_1`` tensors become
:class:`xllm.kernels.quant.QuantizedWeight` views of the file's bytes (``from_gguf``: memory-mapped, not
copied), with llama.cpp's Q/K row interleave undone by a row gather of the quantized rows
(``QuantizedWeight.rows``; blocks run along the input dimension, so whole rows move); every other tensor
(F32/F16/BF16 norms, or a type the kernels do not take, e.g. Q6_K) is dequantized with ``gguf`` into a
float tensor, as :func:`xllm.models.gguf_import.convert_gguf` does.
"""

from __future__ import annotations

import pathlib
import struct
from dataclasses import dataclass, field

import numpy as np
import torch

from xllm.kernels.quant import GGUF_FORMATS, QuantizedWeight, from_gguf
from xllm.models.gguf_import import GGUFImportError, dequantize_float32, hf_tensor_name, qk_heads, unpermute_rows
from xllm.models.tensor_parallel import TPShard


@dataclass
class StoredWeights:
    """A checkpoint's tensors by HF name: the quantized ones as stored, the rest as float32 (what
    :func:`xllm.models.loader.load_stored` builds a model from)."""

    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    floats: dict[str, torch.Tensor] = field(default_factory=dict)
    formats: dict[str, int] = field(default_factory=dict)  # GGML type name -> tensors of that type

    def float_items(self, skip: set[str]) -> list[tuple[str, torch.Tensor]]:
        """The float tensors, plus the quantized ones not in ``skip`` dequantized (what the model keeps
        float: e.g. a fused layer whose parts are stored in different formats)."""
        from xllm.kernels.quant import dequantize

        out = list(self.floats.items())
        out += [(name, dequantize(qw)) for name, qw in self.quantized.items() if name not in skip]
        return out

    def sharded(self, shard: TPShard) -> StoredWeights:
        """The part of these weights tensor-parallel rank ``shard`` holds (:mod:`xllm.models.tensor_parallel`):
        quantized weights sliced as stored (rows; or columns on whole blocks, else
        :class:`~xllm.models.config.ModelConfigError`), float ones as the safetensors path slices them."""
        return StoredWeights({name: shard.shard_quantized(name, qw) for name, qw in self.quantized.items()},
                             {name: shard.shard(name, t) for name, t in self.floats.items()}, dict(self.formats))


def row_unpermutation(rows: int, n_heads: int) -> torch.Tensor:
    """The row index undoing llama.cpp's per-head Q/K interleave: ``w[index]`` is
    :func:`~xllm.models.gguf_import.unpermute_rows` of ``w``."""
    return torch.from_numpy(unpermute_rows(np.arange(rows), n_heads).copy())


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its name, GGML type, shape (numpy order: outermost first) and bytes."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray  # a read-only view of the file mapping: uint8 [..., row bytes] (what gguf.quants reads)


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType sizes
_STRING, _ARRAY, _UINT32 = 8, 9, 4


def gguf_tensors(path: str | pathlib.Path) -> tuple[dict[str, object], list[GGUFTensor]]:
    """The GGUF header's scalar and string metadata (arrays skipped) and its tensors, read from a memory map.

    ``gguf.GGUFReader`` builds a Python object per metadata array element: a 49k-token vocabulary takes it
    ~4 s on this machine; this reads what loading needs in milliseconds (GGUF v2/v3, little-endian)."""
    import gguf

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    raw = memoryview(buf)
    if bytes(raw[:4]) != b"GGUF":
        raise GGUFImportError(f"{path} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", raw, 4)
    if version < 2:
        raise GGUFImportError(f"{path}: GGUF version {version} is not supported")
    at = 24

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", raw, at)
        return bytes(raw[at + 8:at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

    def value(kind: int, at: int) -> tuple[object, int]:
        if kind == _STRING:
            return string(at)
        if kind == _ARRAY:
            (sub, count) = struct.unpack_from("<IQ", raw, at)
            at += 12
            if sub in _SCALAR_BYTES:
                return None, at + count * _SCALAR_BYTES[sub]
            for _ in range(count):
                _, at = value(sub, at)
            return None, at
        size = _SCALAR_BYTES[kind]
        fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[size]
        if kind in (1, 3, 5, 11):
            fmt = fmt.lower()
        elif kind in (6, 12):
            fmt = "<f" if size == 4 else "<d"
        return struct.unpack_from(fmt, raw, at)[0], at + size

    meta: dict[str, object] = {}
    for _ in range(n_kv):
        key, at = string(at)
        (kind,) = struct.unpack_from("<I", raw, at)
        meta[key], at = value(kind, at + 4)
    infos = []
    for _ in range(n_tensors):
        name, at = string(at)
        (n_dims,) = struct.unpack_from("<I", raw, at)
        dims = struct.unpack_from(f"<{n_dims}Q", raw, at + 4)
        kind, offset = struct.unpack_from("<IQ", raw, at + 4 + 8 * n_dims)
        at += 4 + 8 * n_dims + 12
        infos.append((name, kind, tuple(int(d) for d in reversed(dims)), offset))
    align = int(meta.get("general.alignment") or 32)
    start = (at + align - 1) // align * align
    tensors = []
    for name, kind, shape, offset in infos:
        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        row = shape[-1] // block * type_bytes
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        tensors.append(GGUFTensor(name, kind, shape, buf[start + offset:start + offset + rows * row].reshape(
            *shape[:-1], row)))
    return meta, tensors


def read_gguf_weights(gguf_path: str | pathlib.Path, num_heads: int, num_kv_heads: int) -> StoredWeights:
    """Every tensor of ``gguf_path`` (a llama-architecture GGUF) by HF name, quantized ones as stored."""
    import gguf

    meta, tensors = gguf_tensors(gguf_path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFImportError(f"GGUF architecture {arch!r} is not supported (supported: llama)")
    out = StoredWeights()
    for t in tensors:
        name = hf_tensor_name(t.name)
        kind = gguf.GGMLQuantizationType(t.ggml_type)
        out.formats[kind.name] = out.formats.get(kind.name, 0) + 1
        heads = qk_heads(name, num_heads, num_kv_heads)
        if kind.name.lower() in GGUF_FORMATS and len(t.shape) == 2:
            n, k = t.shape
            qw = from_gguf(t.data, kind.name, n, k)
            out.quantized[name] = qw if heads is None else qw.rows(row_unpermutation(n, heads))
        else:
            out.floats[name] = dequantize_float32(t.data, t.ggml_type, heads)
    return out
