"""Compute/communication overlap of a tensor-parallel step (xLLM §4.1, "dual-stream"): the step's
sequences go in two micro-batches whose layers interleave, so that one micro-batch's all-reduce is in
flight while the other computes.

- :func:`split_step` cuts a packed step (decode rows first, then prefill chunks) into two parts by whole
  sequences, balanced by rows, each a :class:`PartStep` its own attention context is built from
  (``kv.addressing.context(part)``);
- a model with :class:`SupportsOverlappedForward` runs ``forward_overlapped`` over the parts'
  :class:`MicroBatch` es (:mod:`xllm.models.llama`): the collectives begun with
  :meth:`~xllm.core.parallel.comm.Communicator.all_reduce_start` are waited on only when the micro-batch
  needs their sum;
- :class:`OverlapChooser` (rank 0's runner, ``--tp-overlap``) decides per step shape: ``on`` overlaps
  every step it can, ``auto`` tries both ways for a few steps per bucket of rows, keeps the faster and
  logs both medians once. Gloo's all-reduce runs in its own threads, so overlapping can hide it; the
  shared-memory all-reduce (and the fused native steps, which take it inside C) runs on the rank's own
  thread, so there the measurement keeps the plain path.

The decision reaches the worker ranks in the step plan (mode ``overlap``): every rank must split and
interleave alike, since the order of the collectives follows the schedule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from xllm.core.kv.addressing import PackedStep, PageAddress, SlotAddress
from xllm.core.model_api import AttentionContext
from xllm.engine_api.errors import ConfigError

log = logging.getLogger(__name__)

OVERLAP_MODES = ("auto", "on", "off")


@dataclass
class MicroBatch:
    """One micro-batch of an overlapped forward: its packed rows and the context they attend through."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: AttentionContext


@runtime_checkable
class SupportsOverlappedForward(Protocol):
    """A model that can interleave two micro-batches' layers around its all-reduces.

    ``overlap_supported()``: whether it can here (a tensor-parallel shard whose layers it knows);
    ``forward_overlapped(parts)``: the final hidden states of every part's rows, in part order, equal to
    ``forward`` of each part alone (concatenated); every rank calls it with the same split."""

    def overlap_supported(self) -> bool: ...

    def forward_overlapped(self, parts: Sequence[MicroBatch]) -> torch.Tensor: ...


@dataclass
class PartStep:
    """A part of a packed step (the :class:`~xllm.core.kv.addressing.PackedStep` fields over its own
    sequences): what addressing builds a part's attention context from."""

    address: SlotAddress | PageAddress
    input_ids: torch.Tensor
    positions: torch.Tensor
    num_decode: int
    decode_context_lens: torch.Tensor
    prefill_query_starts: list[int]
    prefill_context_lens: list[int]


def _part(batch: PackedStep, input_ids: torch.Tensor, d0: int, d1: int, p0: int, p1: int) -> PartStep:
    """Decode sequences ``[d0, d1)`` and prefill chunks ``[p0, p1)`` of ``batch`` (one run of packed rows)."""
    nd, qs = batch.num_decode, batch.prefill_query_starts
    decode_rows = slice(d0, d1)
    first = d0 if d1 > d0 else nd + qs[p0]
    last = nd + qs[p1] if p1 > p0 else d1
    rows = slice(first, last)
    addr = batch.address
    if isinstance(addr, SlotAddress):
        address: SlotAddress | PageAddress = SlotAddress(addr.token_slots[rows], addr.decode_slots[decode_rows],
                                                         addr.prefill_slots[p0:p1])
    elif isinstance(addr, PageAddress):
        tables = addr.decode_block_tables
        address = PageAddress(addr.slot_mapping[rows], tables[decode_rows] if tables is not None and d1 > d0 else None,
                              addr.prefill_block_tables[p0:p1])
    else:
        raise TypeError(f"split_step: unknown address {type(addr).__name__}")
    return PartStep(address, input_ids[rows], batch.positions[rows], d1 - d0, batch.decode_context_lens[decode_rows],
                    [q - qs[p0] for q in qs[p0:p1 + 1]], list(batch.prefill_context_lens[p0:p1]))


def split_step(batch: PackedStep, input_ids: torch.Tensor) -> tuple[PartStep, PartStep] | None:
    """``batch`` (with its packed ``input_ids``) as two parts by whole sequences, the cut where the rows are
    most even (the first part's rows precede the second's); None with fewer than two sequences."""
    nd, qs = batch.num_decode, batch.prefill_query_starts
    p = len(qs) - 1
    if nd + p < 2:
        return None
    ends = list(range(1, nd + 1)) + [nd + q for q in qs[1:]]  # row end of each sequence, in row order
    total = ends[-1]
    cut = min(range(1, nd + p), key=lambda s: abs(2 * ends[s - 1] - total))  # sequences in the first part
    if cut <= nd:
        return _part(batch, input_ids, 0, cut, 0, 0), _part(batch, input_ids, cut, nd, 0, p)
    return _part(batch, input_ids, 0, nd, 0, cut - nd), _part(batch, input_ids, nd, nd, cut - nd, p)


def row_bucket(rows: int) -> int:
    """The step-shape bucket :class:`OverlapChooser` decides per: the next power of two of the rows."""
    return 1 << max(0, rows - 1).bit_length()


@dataclass
class _Trial:
    plain: list[float] = field(default_factory=list)
    overlap: list[float] = field(default_factory=list)
    decision: str | None = None  # "eager" or "overlap" once decided


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


@dataclass
class OverlapChooser:
    """Whether a step that would run eager runs overlapped (rank 0 decides; the plan tells the workers).

    ``mode`` ``on``: always; ``auto``: per :func:`row_bucket` of the step's rows, the first ``2 * trials``
    steps alternate the two ways (plain first), then the faster median keeps the bucket (ties: plain),
    logged once with both medians (``decisions`` keeps them: bucket -> (choice, plain s, overlap s)).
    :meth:`choose` is pure (rank 0 asks it twice a step: the plan, then the forward); :meth:`record` takes
    a step's measured seconds (``clock`` reads the time: a fake one in tests)."""

    mode: str = "auto"
    trials: int = 3
    clock: Callable[[], float] = time.perf_counter
    buckets: dict[int, _Trial] = field(default_factory=dict)
    decisions: dict[int, tuple[str, float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "on"):
            raise ValueError(f"OverlapChooser mode must be auto or on, got {self.mode!r}")
        if self.trials < 1:
            raise ValueError(f"OverlapChooser trials must be >= 1, got {self.trials}")

    def choose(self, rows: int) -> str:
        """``overlap`` or ``eager`` for a step of ``rows`` rows (no state changes)."""
        if self.mode == "on":
            return "overlap"
        t = self.buckets.get(row_bucket(rows))
        if t is None:
            return "eager"
        if t.decision is not None:
            return t.decision
        return "eager" if len(t.plain) <= len(t.overlap) else "overlap"

    def record(self, rows: int, mode: str, seconds: float) -> None:
        """A step of ``rows`` rows ran ``mode`` (``eager`` or ``overlap``) in ``seconds``."""
        if self.mode == "on":
            return
        bucket = row_bucket(rows)
        t = self.buckets.setdefault(bucket, _Trial())
        if t.decision is not None:
            return
        (t.overlap if mode == "overlap" else t.plain).append(seconds)
        if len(t.plain) >= self.trials and len(t.overlap) >= self.trials:
            plain, over = _median(t.plain), _median(t.overlap)
            t.decision = "overlap" if over < plain else "eager"
            self.decisions[bucket] = (t.decision, plain, over)
            log.info("tensor-parallel overlap, steps of %d-%d rows: %s (median of %d steps: plain %.3f ms, "
                     "overlapped %.3f ms)", bucket // 2 + 1, bucket, "on" if t.decision == "overlap" else "off",
                     self.trials, plain * 1e3, over * 1e3)


def overlap_chooser(mode: str, model: object) -> OverlapChooser | None:
    """The chooser ``--tp-overlap`` ``mode`` asks for over ``model``; None with ``off`` or when the model
    cannot overlap (not a tensor-parallel shard, or layers it does not interleave). ``ConfigError`` names
    the flag for an unknown mode."""
    if mode not in OVERLAP_MODES:
        raise ConfigError(f"--tp-overlap must be one of {', '.join(OVERLAP_MODES)}, got {mode!r}")
    if mode == "off" or not isinstance(model, SupportsOverlappedForward) or not model.overlap_supported():
        return None
    return OverlapChooser(mode)
