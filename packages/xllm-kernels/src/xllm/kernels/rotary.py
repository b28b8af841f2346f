"""Rotary position embedding (the "rotate half" / NeoX layout used by HF Llama)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from xllm.kernels import native


@dataclass
class RotaryTable:
    """Precomputed cos/sin for positions ``[0, max_positions)``.

    ``cos`` and ``sin`` are float32 ``[max_positions, rotary_dim]`` with the half
    frequencies repeated (``cat([f, f])``), matching HF's layout.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(
        cls,
        rotary_dim: int,
        max_positions: int,
        base: float,
        inv_freq: torch.Tensor | None = None,
        attention_scaling: float = 1.0,
    ) -> RotaryTable:
        """Build the table; ``inv_freq`` overrides the default ``base**(-2i/d)``
        frequencies (used by scaled RoPE variants)."""
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
        if inv_freq is None:
            exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
            inv_freq = 1.0 / (base**exponent)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq.to(torch.float32))
        emb = torch.cat([freqs, freqs], dim=-1)
        return cls(cos=emb.cos() * attention_scaling, sin=emb.sin() * attention_scaling)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for ``positions`` ([T] int64), cast to ``dtype``: ``[T, rotary_dim]``."""
        if not torch.compiler.is_compiling() and positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"position {int(positions.max())} beyond rotary table of {self.cos.shape[0]}")
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


@dataclass
class RopeBatch:
    """One forward's positions against a :class:`RotaryTable`: what the layers rotate with.

    ``cos_sin(dtype)`` is looked up once and shared by every layer; ``rotate_``
    rotates heads in place inside packed rows (the native kernel when it
    applies, which needs no lookup at all).
    """

    table: RotaryTable
    positions: torch.Tensor
    _cached: dict = field(default_factory=dict)

    def cos_sin(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._cached:
            self._cached[dtype] = self.table.lookup(self.positions, dtype)
        return self._cached[dtype]

    def rotate_(self, rows: torch.Tensor, heads: int, head_dim: int) -> None:
        """Rotate the first ``heads`` heads of each row of ``rows`` ``[T, width]`` in place."""
        rd = self.table.cos.shape[-1]
        lib = native.for_tensors(rows) if rows.dim() == 2 and rd <= 1024 else None
        if lib is not None:
            pos = self.positions.to(torch.int64).contiguous()
            if pos.numel() and int(pos.max()) >= self.table.cos.shape[0]:
                raise ValueError(f"position {int(pos.max())} beyond rotary table of {self.table.cos.shape[0]}")
            getattr(lib.lib, f"xllm_rope_{native.suffix(rows.dtype)}")(
                rows.data_ptr(), rows.shape[0], heads, head_dim, rows.stride(0), self.table.cos.data_ptr(),
                self.table.sin.data_ptr(), pos.data_ptr(), rd)
            return
        view = rows[:, : heads * head_dim].view(rows.shape[0], heads, head_dim)
        cos, sin = self.cos_sin(rows.dtype)
        view.copy_(apply_rotary(view, cos, sin))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by ``cos``/``sin`` ``[T, rotary_dim]``.

    When ``rotary_dim < head_dim`` only the leading ``rotary_dim`` channels rotate
    (partial rotary); the rest pass through.
    """
    rd = cos.shape[-1]
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    if rd == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)
