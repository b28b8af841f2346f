"""Weight-only quantized linears: packed formats, (de)quantization and the quantized product.

A :class:`QuantizedWeight` is the logical weight ``[n, k]`` (``[out_features, in_features]``) in one of
:data:`FORMATS`:

- ``"q8_0"``, ``"q4_0"``, ``"q4_1"``: the GGUF block formats, ``data`` holds the bytes exactly as stored
  in the file, ``[n, k / 32 * block_bytes]`` row-major (a Q8_0 block is an fp16 scale ``d`` and 32 int8
  values, ``w = d * q``; Q4_0 an fp16 ``d`` and 16 bytes of nibbles, ``w = d * (q - 8)``; Q4_1 fp16 ``d``
  and ``m`` and 16 bytes of nibbles, ``w = d * q + m``; byte ``j`` of a block holds element ``j`` in its
  low nibble and element ``j + 16`` in its high one). ``scales`` and ``zeros`` are None.
- ``"int8"``: per-output-channel symmetric, ``data`` ``[n, k]`` uint8 holding int8 values (two's
  complement), ``scales`` fp32 ``[n]``, ``w = scale * q``.
- ``"w8a8"``: the weight as ``"int8"`` stores it, and the activations rounded to int8 too in every
  product: each row of ``x`` with its own scale ``amax / 127`` (nearest even), exact int32 sums, then
  ``(float(sum) * w_scale) * x_scale (+ bias)`` in fp32 (VNNI's twice-bf16 multiply rate for batched
  decode and prefill; a row's result never depends on the other rows). It is the only format whose
  product is not ``x @ dequantize(w).T``: :func:`w8a8_reference` is its definition. Each such weight
  made by :func:`quantize` or :func:`cat_rows` also carries ``packed``, the int8 GEMM's copy of ``data``
  (:func:`pack_w8a8`: twice int8's memory); without it (``rows()``: embedding lookups, which only
  dequantize) the kernel transposes each panel per call, with the same result.
- ``"int4_g32"``, ``"int4_g128"``: group-wise asymmetric uint4 along k, ``data`` ``[n, k / 2]`` packed
  like the GGUF Q4 nibbles per 32 elements, ``scales`` fp16 ``[n, k / group]``, ``zeros`` uint8
  ``[n, k / group]`` (integer zero points 0..15), ``w = scale * (q - zero)``.

:func:`dequantize` is bit-equal to ``gguf.quants.dequantize`` for the GGUF formats, and
:func:`quantize` to ``gguf.quants.quantize`` (which follows ggml's reference quantizers).
:func:`quant_linear` is ``x @ dequantize(w).T + bias``: the native kernels (``kernels/cpu/gemm_quant.c``,
see :mod:`xllm.kernels.quant_native`) stream the packed weight and dequantize in registers; without
them it dequantizes and calls ``F.linear``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from xllm.kernels import quant_native
from xllm.kernels.sampling import argmax_rows

FORMATS: tuple[str, ...] = ("q8_0", "q4_0", "q4_1", "int8", "int4_g32", "int4_g128", "w8a8")
#: formats stored as int8 per output channel (``data`` int8 ``[n, k]``, fp32 ``scales [n]``)
PER_CHANNEL_FORMATS: tuple[str, ...] = ("int8", "w8a8")
GGUF_FORMATS: tuple[str, ...] = ("q8_0", "q4_0", "q4_1")
BLOCK = 32
#: bytes of one 32-element block of each GGUF format
BLOCK_BYTES: dict[str, int] = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
_GROUP: dict[str, int] = {"int4_g32": 32, "int4_g128": 128}


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized weight ``[n, k]`` (see the module docstring for each format's layout)."""

    fmt: str
    n: int
    k: int
    data: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    #: ``"w8a8"`` only, optional: :func:`pack_w8a8` of ``data``
    packed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("data", "scales", "zeros", "packed"):  # held as tensors of their own, not views of
            t = getattr(self, name)                         # others: a copy (xllm.models.placement's)
            if t is not None and t._base is not None:       # repointing one then frees the memory it left
                object.__setattr__(self, name, t.detach())
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantized format {self.fmt!r}; expected one of {FORMATS}")
        if not supports(self.fmt, self.k):
            raise ValueError(f"format {self.fmt} does not support k={self.k}")
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != (self.n, row_bytes(self.fmt, self.k)):
            raise ValueError(f"{self.fmt} data must be uint8 [{self.n}, {row_bytes(self.fmt, self.k)}], "
                             f"got {self.data.dtype} {list(self.data.shape)}")
        if self.packed is not None:
            if self.fmt != "w8a8":
                raise ValueError(f"only w8a8 weights carry packed panels, not {self.fmt}")
            want = _w8a8_packed_bytes(self.n, self.k)
            if self.packed.dtype != torch.uint8 or self.packed.shape != (want,):
                raise ValueError(f"w8a8 packed panels must be uint8 [{want}], got {self.packed.dtype} "
                                 f"{list(self.packed.shape)}")

    @property
    def group(self) -> int:
        """Elements along k that share one scale (k itself for int8)."""
        return self.k if self.fmt in PER_CHANNEL_FORMATS else _GROUP.get(self.fmt, BLOCK)

    def nbytes(self) -> int:
        """Bytes a full GEMV streams: data + scales + zeros."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.zeros) if t is not None)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight made of output rows ``index`` (a 1-D integer tensor; gathers, permutes or repeats)."""
        index = index.to(torch.long)
        data, scales, zeros = (None if t is None else t.index_select(0, index).contiguous()
                               for t in (self.data, self.scales, self.zeros))
        return QuantizedWeight(self.fmt, int(index.numel()), self.k, data, scales, zeros)

    def contiguous(self) -> QuantizedWeight:
        """The same weight with every tensor contiguous (what the native kernels need): itself when they are."""
        if all(t is None or t.is_contiguous() for t in (self.data, self.scales, self.zeros, self.packed)):
            return self
        data, scales, zeros, packed = (None if t is None else t.contiguous()
                                       for t in (self.data, self.scales, self.zeros, self.packed))
        return QuantizedWeight(self.fmt, self.n, self.k, data, scales, zeros, packed)


#: output rows per panel of :func:`pack_w8a8` (XW_NR of kernels/cpu/gemm_w8a8.h)
W8A8_PANEL_ROWS = 48


def pack_w8a8(data: torch.Tensor) -> torch.Tensor:
    """The int8 GEMM's copy of a w8a8 weight's ``data`` (int8 ``[n, k]`` as uint8), as flat bytes: for
    each panel of 48 output rows (rows past ``n`` zero), the quads of 4 consecutive k of its 48 rows,
    ``[k / 4][48][4]``, then, as int32, ``128 * sum_k q[row, k]`` of its 48 rows (the kernel takes its
    unsigned activation offset back with it). Each panel is self-contained (``48 * k + 192`` bytes), so
    the panels from any multiple of 48 rows on are a weight of their own (a greedy LM head's column chunks)."""
    n, k = data.shape
    rows = _w8a8_panel_rows(n)
    q = torch.zeros(rows, k, dtype=torch.int8)
    q[:n] = data.view(torch.int8)
    np_ = rows // W8A8_PANEL_ROWS
    panels = q.reshape(np_, W8A8_PANEL_ROWS, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    comp = (q.to(torch.int32).sum(dim=1) * 128).to(torch.int32).reshape(np_, W8A8_PANEL_ROWS)
    return torch.cat([panels.view(torch.uint8).reshape(np_, -1), comp.view(torch.uint8)], dim=1).reshape(-1)


def _w8a8_panel_rows(n: int) -> int:
    return -(-n // W8A8_PANEL_ROWS) * W8A8_PANEL_ROWS


def _w8a8_packed_bytes(n: int, k: int) -> int:
    return _w8a8_panel_rows(n) * (k + 4)  # per panel: its quads, then one int32 offset sum per row


def supports(fmt: str, k: int) -> bool:
    """Whether ``fmt`` can hold a weight with ``k`` input features (k a positive multiple of its group)."""
    if fmt not in FORMATS or k < 1:
        return False
    return k % _GROUP.get(fmt, BLOCK) == 0


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one output row of ``data``."""
    if fmt in BLOCK_BYTES:
        return k // BLOCK * BLOCK_BYTES[fmt]
    if fmt in PER_CHANNEL_FORMATS:
        return k
    return k // 2


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The rows of ``parts`` stacked in order (fused qkv / gate_up); all share ``fmt`` and ``k``."""
    if not parts:
        raise ValueError("cat_rows needs at least one weight")
    fmt, k = parts[0].fmt, parts[0].k
    if any(p.fmt != fmt or p.k != k for p in parts):
        raise ValueError(f"cat_rows needs one format and k, got {[(p.fmt, p.k) for p in parts]}")
    data, scales, zeros = (None if ts[0] is None else torch.cat(ts, 0) for ts in zip(
        *((p.data, p.scales, p.zeros) for p in parts), strict=True))
    packed = pack_w8a8(data) if fmt == "w8a8" else None  # (a fused projection: products read it)
    return QuantizedWeight(fmt, sum(p.n for p in parts), k, data, scales, zeros, packed)


def from_gguf(raw: object, ggml_type: str, n: int, k: int) -> QuantizedWeight:
    """A GGUF tensor's bytes as a :class:`QuantizedWeight`, without dequantizing and, when ``raw`` is
    a C-contiguous uint8 tensor or numpy array (e.g. ``gguf.GGUFReader``'s memmap), without copying: the weight then
    aliases the file mapping and must not be written to. ``ggml_type`` is the type name (``"Q4_1"``,
    case-insensitive), ``n``/``k`` the logical shape (GGUF lists it as ``[k, n]``)."""
    fmt = ggml_type.lower()
    if fmt not in GGUF_FORMATS:
        raise ValueError(f"unsupported GGUF tensor type {ggml_type!r}; expected one of "
                         f"{[f.upper() for f in GGUF_FORMATS]}")
    if not isinstance(raw, torch.Tensor):
        with warnings.catch_warnings():  # read-only memmaps: torch warns that writes are undefined
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(raw)
    data = raw.contiguous().view(torch.uint8)
    if not supports(fmt, k) or data.numel() != n * row_bytes(fmt, k):
        raise ValueError(f"{ggml_type} tensor of {data.numel()} bytes does not hold a [{n}, {k}] weight")
    return QuantizedWeight(fmt, n, k, data.reshape(n, row_bytes(fmt, k)))


# ---------------------------------------------------------------------------------------------------
# dequantization (torch reference; bit-equal to gguf's numpy code for the GGUF formats)


def _fp16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block ``[nb, bytes]`` as fp32 ``[nb, 1]``."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 packed bytes per block ``[nb, 16]`` -> the 32 values ``[nb, 32]`` (low nibbles first)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``[n, k]`` (computed in fp32, then cast to ``dtype``)."""
    n, k = qw.n, qw.k
    if qw.fmt in BLOCK_BYTES:
        blocks = qw.data.reshape(n * (k // BLOCK), BLOCK_BYTES[qw.fmt])
        d = _fp16_at(blocks, 0)
        if qw.fmt == "q8_0":
            w = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d
        elif qw.fmt == "q4_0":
            w = d * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).to(torch.float32)
        else:
            w = d * _nibbles(blocks[:, 4:]).to(torch.float32) + _fp16_at(blocks, 2)
    elif qw.fmt in PER_CHANNEL_FORMATS:
        w = qw.data.view(torch.int8).to(torch.float32) * qw.scales.to(torch.float32)[:, None]
    else:
        g = qw.group
        q = _nibbles(qw.data.reshape(n * k // BLOCK, BLOCK // 2)).reshape(n, k // g, g).to(torch.float32)
        s = qw.scales.to(torch.float32)[..., None]
        w = (q - qw.zeros.to(torch.float32)[..., None]) * s
    return w.reshape(n, k).to(dtype)


# ---------------------------------------------------------------------------------------------------
# quantization


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero exactly like gguf's ``np_roundf`` (and C ``roundf``)."""
    a = x.abs()
    fl = torch.floor(a)
    return torch.sign(x) * (fl + torch.floor(2 * (a - fl)))


def _safe_inv(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 ``[nb, 32]`` -> ``[nb, 16]`` bytes (element j low, j + 16 high)."""
    q = q.to(torch.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).view(torch.uint8)


def _quantize_gguf(w: torch.Tensor, fmt: str) -> torch.Tensor:
    blocks = w.reshape(-1, BLOCK)
    if fmt == "q8_0":
        d = blocks.abs().amax(dim=1, keepdim=True) / 127
        qs = _round_away(blocks * _safe_inv(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_fp16_bytes(d), qs], dim=1)
    if fmt == "q4_0":
        imax = blocks.abs().argmax(dim=1, keepdim=True)
        d = blocks.gather(1, imax) / -8
        qs = torch.trunc(blocks * _safe_inv(d) + 8.5).clamp(0, 15)
        return torch.cat([_fp16_bytes(d), _pack_nibbles(qs)], dim=1)
    lo, hi = blocks.amin(dim=1, keepdim=True), blocks.amax(dim=1, keepdim=True)
    d = (hi - lo) / 15
    qs = torch.trunc((blocks - lo) * _safe_inv(d) + 0.5).clamp(0, 15)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(lo), _pack_nibbles(qs)], dim=1)


def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Quantize a float weight ``[n, k]`` (computed in fp32). GGUF formats use ggml's reference
    quantizers (byte-equal to ``gguf.quants.quantize``); ``int8`` (and ``w8a8``) scales each row by ``amax / 127``
    (round half away from zero); ``int4_g*`` maps each group's ``[min, max]`` to 0..15 with
    ``scale = (max - min) / 15`` (fp16) and ``zero = round(-min / scale)``, so every element is
    within ``scale / 2`` (plus the fp16 rounding of the scale) of its original value."""
    if w.dim() != 2:
        raise ValueError(f"quantize needs a 2-D weight, got shape {list(w.shape)}")
    n, k = w.shape
    if not supports(fmt, k):
        raise ValueError(f"format {fmt!r} cannot hold k={k} (known formats: {FORMATS})")
    w = w.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if fmt in BLOCK_BYTES:
        return QuantizedWeight(fmt, n, k, _quantize_gguf(w, fmt).reshape(n, row_bytes(fmt, k)))
    if fmt in PER_CHANNEL_FORMATS:
        s = w.abs().amax(dim=1) / 127
        q = _round_away(w * _safe_inv(s)[:, None]).clamp(-127, 127).to(torch.int8)
        data = q.view(torch.uint8)
        return QuantizedWeight(fmt, n, k, data, scales=s.contiguous(),
                               packed=pack_w8a8(data) if fmt == "w8a8" else None)
    g = _GROUP[fmt]
    groups = w.reshape(n, k // g, g)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    # the range always includes 0 so that zero stays exact and the zero point lies in 0..15
    lo, hi = torch.minimum(lo, torch.zeros_like(lo)), torch.maximum(hi, torch.zeros_like(hi))
    s = ((hi - lo) / 15).to(torch.float16).to(torch.float32)
    inv = _safe_inv(s)
    z = _round_away(-lo * inv).clamp(0, 15)
    q = (_round_away(groups * inv[..., None]) + z[..., None]).clamp(0, 15)
    data = _pack_nibbles(q.reshape(-1, BLOCK)).reshape(n, k // 2)
    return QuantizedWeight(fmt, n, k, data, scales=s.to(torch.float16), zeros=z.to(torch.uint8))


# ---------------------------------------------------------------------------------------------------
# the product


def quant_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ dequantize(qw).T + bias`` for ``x [..., k]`` in bf16/fp32, returned in ``x.dtype`` (or
    ``out_dtype``). Up to 8 rows run the native skinny GEMV (one pass over the packed weight,
    dequantized in registers); more rows the native large-batch path; without the native library
    (``XLLM_NATIVE=0``, no AVX-512) or under ``torch.compile``: dequantize to ``x.dtype`` and ``F.linear``.
    A ``"w8a8"`` weight's product is :func:`w8a8_reference`'s instead (natively, or that function itself)."""
    if x.shape[-1] != qw.k:
        raise ValueError(f"quant_linear: x has {x.shape[-1]} features, the weight expects {qw.k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, qw.k)
    y = quant_native.linear(x2, qw.contiguous(), bias, out_dtype)
    if y is None and qw.fmt == "w8a8":
        y = w8a8_reference(x2, qw, bias).to(out_dtype or x.dtype)
    if y is None:
        wdtype = x2.dtype if x2.dtype in (torch.bfloat16, torch.float32) else torch.float32
        y = F.linear(x2.to(wdtype), dequantize(qw, wdtype), None if bias is None else bias.to(wdtype))
        y = y.to(out_dtype or x.dtype)
    return y.reshape(*lead, qw.n)


def quant_argmax(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The row argmax (int64 ``[m]``, first index on ties) of ``quant_linear(x, qw, bias).float()`` for
    ``x [m, k]``, exactly: a greedy LM head; natively without writing the product where
    :func:`quant_linear` runs natively, else by computing it."""
    if x.dim() != 2 or x.shape[-1] != qw.k:
        raise ValueError(f"quant_argmax: x {tuple(x.shape)} does not match the weight's {qw.k} features")
    out = quant_native.argmax(x, qw.contiguous(), bias)
    return out if out is not None else argmax_rows(quant_linear(x, qw, bias).float())


def w8a8_reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``"w8a8"`` product in fp32 ``[m, n]`` for ``x [m, k]``: each row of ``x`` rounded to int8 with
    scale ``amax(|row|) / 127`` (nearest even; 1 for a row of zeros), exact integer sums against the int8
    weight, then ``(float32(sum) * w_scale) * x_scale (+ bias)`` in fp32, the native kernel's order
    (``kernels/cpu/gemm_w8a8.h``)."""
    if qw.fmt not in PER_CHANNEL_FORMATS:
        raise ValueError(f"w8a8_reference needs an int8-layout weight, got {qw.fmt}")
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=1)
    sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    qx = torch.round(xf * (1 / sx)[:, None]).clamp(-127, 127)
    sums = (qx.to(torch.float64) @ qw.data.view(torch.int8).to(torch.float64).T).to(torch.float32)  # exact
    y = sums * qw.scales.to(torch.float32)[None, :] * sx[:, None]
    return y if bias is None else y + bias.to(torch.float32)
