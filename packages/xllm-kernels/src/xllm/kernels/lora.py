"""The segmented LoRA product of one projection over a step's rows (multi-LoRA serving).

A projection with resident adapters (:class:`xllm.models.lora.LoraProjection`) holds per adapter slot ``s``
``A[s]`` ``[n_parts * rank, in]`` and ``B[s]`` ``[out, rank]`` (zero padded to the stack's largest rank; a fused
projection, qkv or gate_up, has one part per checkpoint projection, its :class:`LoraLayout`: part ``p``'s A rows
are ``p * rank .. p * rank + rank - 1`` and its output rows' B rows hold that part's ``rank`` columns, so B has
no zero blocks to stream), and a scale per slot. :func:`segmented_lora` adds to each row ``t`` of the base
projection's output, for each part ``p`` (output columns ``P``)

    ``out[t, P] += scales[s] * (x[t] @ A[s, p]^T) @ B[s, P]^T``  with ``s = slots[t]`` (``-1``: the base model)

in one native call (``kernels/cpu/lora.c``: rows grouped by slot, so each adapter's A and B are streamed once per
call; OpenMP) where the library and the tensors allow it, else with the torch loop over the step's distinct
slots and the parts (:func:`torch_segmented_lora`, also the reference of the tests).

Rounding (bf16): the native kernel keeps the torch loop's rounding points: ``h = x @ A^T`` rounded to bf16 (torch's
bf16 matmul: fp32 sums, one rounding), the delta ``h @ B^T`` rounded to bf16, then ``index_add_(alpha=scale)``'s
``out + round(scale) * delta`` (the scale rounded to bf16, one rounding of the sum, as its 32-column vectors do;
its scalar tail, a row's last ``out % 32`` columns, rounds ``alpha * delta`` first). Elsewhere the two differ only
where their fp32 sums' order flips a rounding. fp32: summation order only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from xllm.kernels import native

_VP, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
#: the largest rank per part the native kernel takes (its expand tile lives on the thread's stack)
MAX_NATIVE_RANK = 256
#: the most parts of one projection the native kernel takes (``LORA_MAX_PARTS``)
MAX_NATIVE_PARTS = 8


@dataclass(frozen=True)
class LoraRows:
    """Which adapter slot each row of one forward uses.

    ``slots``: int64 ``[T]`` (``-1``: the base model); ``scales``: float32 ``[n_slots]``, the scale of every
    slot; ``groups``: ``(slot, rows, scale)`` per slot the rows use (ascending slot, ``rows`` the int64 row
    indices), what the torch loop and per-slot users (MoE experts) iterate over. The same groups as the native
    kernels take them (``XllmLoraGroups``, made once per forward): int64 ``order`` (the rows of every group,
    group after group), ``gslot`` (each group's slot) and ``gstart`` (``[groups + 1]``, where each group's rows
    start in ``order``)."""

    slots: torch.Tensor
    scales: torch.Tensor
    groups: tuple[tuple[int, torch.Tensor, float], ...]
    order: torch.Tensor
    gslot: torch.Tensor
    gstart: torch.Tensor

    @classmethod
    def of(cls, slots: torch.Tensor, scales: Sequence[float]) -> LoraRows:
        """The rows of ``slots`` (int64 ``[T]``, values in ``[-1, len(scales))``) with the slots' ``scales``."""
        slots = slots.reshape(-1).to(torch.int64).contiguous()
        groups = tuple((int(s), (slots == s).nonzero().flatten(), float(scales[s]))
                       for s in torch.unique(slots).tolist() if s >= 0)
        order = torch.cat([idx for _, idx, _ in groups]) if groups else torch.empty(0, dtype=torch.int64)
        gstart = torch.tensor([0, *(len(idx) for _, idx, _ in groups)], dtype=torch.int64).cumsum(0)
        return cls(slots, torch.tensor(list(scales), dtype=torch.float32), groups, order.contiguous(),
                   torch.tensor([s for s, _, _ in groups], dtype=torch.int64), gstart)


@dataclass(frozen=True)
class LoraLayout:
    """The part layout of a projection's adapter weights: ``rank`` A rows / B columns per part (the stack's
    largest rank), and per part its first output row (``starts``) and output rows (``sizes``), in part order."""

    rank: int
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    start_tensor: torch.Tensor
    size_tensor: torch.Tensor

    @classmethod
    def of(cls, rank: int, parts: Iterable[tuple[int, int, int]]) -> LoraLayout:
        """From ``(index, first output row, rows)`` per part (:attr:`LoraProjection.parts` values)."""
        ordered = sorted(parts)
        if [i for i, _, _ in ordered] != list(range(len(ordered))) or rank < 1:
            raise ValueError(f"parts must be indexed 0..n-1 and rank >= 1, got {ordered}, rank {rank}")
        starts = tuple(start for _, start, _ in ordered)
        sizes = tuple(size for _, _, size in ordered)
        return cls(rank, starts, sizes, torch.tensor(starts, dtype=torch.int64),
                   torch.tensor(sizes, dtype=torch.int64))

    @property
    def n_parts(self) -> int:
        return len(self.starts)


def _check(x2: torch.Tensor, out2: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoraRows,
           layout: LoraLayout) -> None:
    n = layout.n_parts * layout.rank
    if (x2.dim() != 2 or out2.dim() != 2 or a.dim() != 3 or b.dim() != 3 or x2.shape[0] != out2.shape[0]
            or a.shape[1:] != (n, x2.shape[1]) or b.shape != (a.shape[0], out2.shape[1], layout.rank)
            or rows.slots.shape != (x2.shape[0],) or rows.scales.shape != (a.shape[0],)
            or (len(rows.groups) and int(rows.gslot[-1]) >= a.shape[0])
            or max((s + z for s, z in zip(layout.starts, layout.sizes, strict=True)), default=0) > out2.shape[1]):
        raise ValueError(f"segmented_lora: x {tuple(x2.shape)}, out {tuple(out2.shape)}, A {tuple(a.shape)}, "
                         f"B {tuple(b.shape)}, slots {tuple(rows.slots.shape)}, scales {tuple(rows.scales.shape)} "
                         f"and {layout.n_parts} parts of rank {layout.rank} do not fit together")


def torch_segmented_lora(x2: torch.Tensor, out2: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         rows: LoraRows, layout: LoraLayout) -> torch.Tensor:
    """The torch loop over ``rows.groups``: ``index_select`` the slot's rows, ``h = xs @ A^T``, then per part
    ``h_p @ B_p^T`` ``index_add_``-ed with the slot's scale into the part's columns of ``out2`` (in place; the
    tensors' dtype); returns ``out2``."""
    r = layout.rank
    for slot, idx, scale in rows.groups:
        h = x2.index_select(0, idx) @ a[slot].t()
        for p, (start, size) in enumerate(zip(layout.starts, layout.sizes, strict=True)):
            delta = h[:, p * r:(p + 1) * r] @ b[slot, start:start + size].t()
            out2[:, start:start + size].index_add_(0, idx, delta, alpha=scale)
    return out2


def native_segmented_lora(x2: torch.Tensor, out2: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoraRows,
                          layout: LoraLayout) -> bool:
    """The product by ``kernels/cpu/lora.c`` into ``out2`` (in place); False (``out2`` untouched) where it cannot
    run: no native library (``XLLM_NATIVE=0``, no AVX-512 BF16 or compiler), tensors not all contiguous CPU
    bf16/fp32 of one dtype, under ``torch.compile``, a rank above :data:`MAX_NATIVE_RANK` or more than
    :data:`MAX_NATIVE_PARTS` parts."""
    if layout.rank > MAX_NATIVE_RANK or layout.n_parts > MAX_NATIVE_PARTS or rows.slots.device.type != "cpu":
        return False
    lib = native.for_tensors(x2, out2, a, b)
    if lib is None:
        return False
    if not rows.groups or x2.shape[0] == 0:
        return True
    sfx = native.suffix(x2.dtype)
    fn = lib.fn(f"xllm_lora_segmented_{sfx}", [_VP, _VP, _I64, _I64, _I64, _VP, _VP, _VP, _VP, _VP, _I64, _VP,
                                                _I64, _VP, _VP, _I64], _I32)
    rc = fn(x2.data_ptr(), out2.data_ptr(), x2.shape[0], x2.shape[1], out2.shape[1], a.data_ptr(), b.data_ptr(),
            rows.order.data_ptr(), rows.gslot.data_ptr(), rows.gstart.data_ptr(), len(rows.groups),
            rows.scales.data_ptr(), layout.n_parts, layout.start_tensor.data_ptr(), layout.size_tensor.data_ptr(),
            layout.rank)
    if rc != 0:
        raise MemoryError("segmented_lora: the native kernel could not allocate its scratch rows")
    return True


def segmented_lora(x2: torch.Tensor, out2: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoraRows,
                   layout: LoraLayout) -> torch.Tensor:
    """Add every row's adapter delta to ``out2`` in place and return it: ``x2`` ``[T, in]`` the projection's
    input rows, ``out2`` ``[T, out]`` its base output, ``a`` ``[slots, n_parts * rank, in]`` and ``b``
    ``[slots, out, rank]`` the stack's weights in the model dtype, ``rows`` the rows' slots, ``layout``
    the parts. The native kernel where :func:`native_segmented_lora` runs, else :func:`torch_segmented_lora`
    (the same rounding points, see the module docstring). ValueError where the shapes disagree."""
    _check(x2, out2, a, b, rows, layout)
    if not native_segmented_lora(x2, out2, a, b, rows, layout):
        torch_segmented_lora(x2, out2, a, b, rows, layout)
    return out2
