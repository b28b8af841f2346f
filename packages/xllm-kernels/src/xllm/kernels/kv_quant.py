"""Quantized KV rows (``--kv-cache-dtype int8|fp8_e4m3``): the byte layout, encoding and decoding.

A quantized cache keeps, for every token and KV head, ``head_dim`` one-byte codes followed by their
fp32 scale (per token, per head): one token's row of a layer's K (or V) is ``kv_heads`` such
``head_dim + 4``-byte pieces back to back, then zero padding up to :attr:`KVQuantFormat.row_bytes`
(padding only where a backend needs whole OS pages per block). Because the scales live inside the
rows, everything that copies KV pages as bytes (prefix cache, KV tiers, PD hand-off) carries them.

Codes (symmetric, per (token, head) ``amax = max |x|`` over the head's channels, in fp32):

- ``int8``: ``scale = amax / 127``, ``code = round_half_even(x / scale)`` clamped to ±127;
- ``fp8_e4m3``: ``scale = amax / 448``, ``code = e4m3fn(clamp(x / scale, ±448))`` (nearest even);

``x / scale`` divides by 1 instead when ``amax == 0`` (codes 0). Decoding is ``code * scale`` in fp32.
The native kernels (``kernels/cpu/kv_quant.h``) encode bit-identically and decode the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_QUANT_KINDS = ("int8", "fp8_e4m3")
SCALE_BYTES = 4  # one fp32 scale per (token, head)
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
_CODE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class KVQuantFormat:
    """One quantized K or V row: ``kv_heads`` pieces of ``head_dim`` codes + an fp32 scale, padded to
    ``row_bytes`` (``>= kv_heads * (head_dim + 4)``)."""

    kind: str
    kv_heads: int
    head_dim: int
    row_bytes: int

    def __post_init__(self) -> None:
        if self.kind not in _QMAX:
            raise ValueError(f"unknown quantized KV kind {self.kind!r}; known: {', '.join(KV_QUANT_KINDS)}")
        if self.head_dim % 4:
            raise ValueError(f"quantized KV needs a head_dim divisible by 4 (fp32 scales stay aligned), "
                             f"got {self.head_dim}")
        if self.row_bytes < self.packed_bytes:
            raise ValueError(f"a row of {self.kv_heads} x ({self.head_dim} + 4) bytes does not fit in "
                             f"{self.row_bytes} bytes")

    @property
    def head_bytes(self) -> int:
        return self.head_dim + SCALE_BYTES

    @property
    def packed_bytes(self) -> int:
        """Bytes of a row without padding."""
        return self.kv_heads * self.head_bytes

    @property
    def qmax(self) -> float:
        return _QMAX[self.kind]

    @property
    def code_dtype(self) -> torch.dtype:
        return _CODE_DTYPES[self.kind]

    @property
    def fp8(self) -> bool:
        return self.kind == "fp8_e4m3"


def row_bytes(kv_heads: int, head_dim: int, align: int = 1) -> int:
    """Bytes of one token's quantized row of ``kv_heads`` heads, rounded up to a multiple of ``align``."""
    raw = kv_heads * (head_dim + SCALE_BYTES)
    return -(-raw // align) * align


def quantize(x: torch.Tensor, fmt: KVQuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., kv_heads, head_dim]`` -> (codes ``uint8 [..., kv_heads, head_dim]``, fp32 scales
    ``[..., kv_heads]``), as the module docstring defines them."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / fmt.qmax
    div = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    y = xf / div
    if fmt.fp8:
        codes = y.clamp(-fmt.qmax, fmt.qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = torch.round(y).clamp(-fmt.qmax, fmt.qmax).to(torch.int8).view(torch.uint8)
    return codes, scale


def encode_rows(x: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """``x`` ``[..., kv_heads, head_dim]`` -> quantized rows ``uint8 [..., row_bytes]`` (padding zero)."""
    codes, scale = quantize(x, fmt)
    lead = x.shape[:-2]
    out = torch.zeros(*lead, fmt.row_bytes, dtype=torch.uint8, device=x.device)
    heads = out[..., :fmt.packed_bytes].unflatten(-1, (fmt.kv_heads, fmt.head_bytes))
    heads[..., :fmt.head_dim] = codes
    heads[..., fmt.head_dim:] = scale.unsqueeze(-1).contiguous().view(torch.uint8)
    return out


def decode_rows(rows: torch.Tensor, fmt: KVQuantFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantized rows ``uint8 [..., row_bytes]`` (any strides) -> ``[..., kv_heads, head_dim]`` of
    ``code * scale`` (computed in fp32, then cast to ``dtype``)."""
    heads = rows[..., :fmt.packed_bytes].unflatten(-1, (fmt.kv_heads, fmt.head_bytes))
    codes = heads[..., :fmt.head_dim].contiguous().view(fmt.code_dtype).float()
    scale = heads[..., fmt.head_dim:].contiguous().view(torch.float32)  # [..., kv_heads, 1]
    out = codes * scale
    return out if dtype == torch.float32 else out.to(dtype)
