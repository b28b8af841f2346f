"""Adaptive graph mode (xLLM §4.2) on the CPU.

Each pure-decode step picks how it runs from its batch size:

- ``native``: up to ``max_batch`` sequences (the native row limit, 8) run the model's
  fused native decoder (one call for the whole forward: the CPU counterpart of
  replaying a captured graph);
- ``compiled``: larger decode batches run a ``torch.compile`` (Inductor) graph of
  the model's forward with the batch dimension as a symbolic parameter (one
  graph for the whole bucket, weights frozen and prepacked by Inductor, KV
  caches passed in and mutated by an opaque attention op);
- ``eager``: prefill and mixed batches (several dynamic dimensions) and
  anything outside the compiled bucket (the "partial graph" fallback).

Compiled graphs are built and warmed up at engine start (with a progress bar)
and Inductor's FX-graph cache (under ``$XLLM_CACHE_DIR/inductor``) makes later
starts reuse them. Compilation is opt-in (``EngineConfig.compile_decode``): on the 2-core
development machine a compiled bucket took ~55 s to build and ran decode steps
slower than the eager path with native kernels (see docs/performance.md).
"""

from __future__ import annotations

import logging
import os
import pathlib
import time

import torch

from xllm.common import cache_dir

log = logging.getLogger(__name__)


class _GraphAttention:
    """Attention context used while tracing: only tensors, no Python-side batch state."""

    def __init__(self, slots: torch.Tensor, positions: torch.Tensor, k_caches, v_caches) -> None:
        self.slots, self.positions = slots, positions
        self.k_caches, self.v_caches = k_caches, v_caches

    def attention(self, layer, q, k, v, scale, v_dim=None):
        return torch.ops.xllm.decode_attention_write(q, k, v, self.k_caches[layer], self.v_caches[layer], self.slots,
                                                     self.positions, scale)


def inductor_cache_dir() -> pathlib.Path:
    """Where Inductor keeps compiled decode graphs: ``inductor/`` in the xLLM cache."""
    return cache_dir("inductor")


class CompiledDecode:
    """A ``torch.compile``d decode forward for batch sizes in ``[min_batch, max_batch]``."""

    def __init__(self, model, kv, min_batch: int, max_batch: int) -> None:
        import xllm.kernels.graph_ops  # noqa: F401  (registers torch.ops.xllm.*)

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
        self.model, self.kv = model, kv
        self.min_batch, self.max_batch = min_batch, max_batch
        layers = kv.layout.spec.num_layers
        self._k = [kv.layer_kv(i)[0] for i in range(layers)]
        self._v = [kv.layer_kv(i)[1] for i in range(layers)]
        self._fn = torch.compile(self._forward, dynamic=True, options={"freezing": True})
        self.calls = 0

    def _forward(self, input_ids, positions, slots, k_caches, v_caches):
        hidden = self.model.forward(input_ids, positions, _GraphAttention(slots, positions, k_caches, v_caches))
        return self.model.compute_logits(hidden)

    def covers(self, batch_size: int) -> bool:
        return self.min_batch <= batch_size <= self.max_batch

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self._fn(input_ids, positions, slots, self._k, self._v)

    def warmup(self, scratch_slot: int, progress: bool = True) -> float:
        """Compile (or load from the cache) by running the bucket's smallest and largest
        sizes on a scratch slot; returns the seconds it took. Inputs are made outside
        inference mode, like the engine's, so the graph's guards match at run time."""
        from tqdm.auto import tqdm

        start = time.perf_counter()
        sizes = sorted({self.min_batch, self.max_batch})
        for b in tqdm(sizes, desc="compiling decode graphs", unit="graph", disable=not progress, leave=False):
            ids = torch.zeros(b, dtype=torch.long)
            pos = torch.zeros(b, dtype=torch.long)
            slots = torch.full((b,), scratch_slot, dtype=torch.long)
            self(ids, pos, slots)
        took = time.perf_counter() - start
        log.info("decode graph for batch %d-%d ready in %.1fs", self.min_batch, self.max_batch, took)
        return took


def build_compiled_decode(model, kv, runner, max_num_seqs: int) -> CompiledDecode | None:
    """Compile and warm up the decode graph for the batch sizes the fused native decoder does not
    take (up to ``max_num_seqs``), on a scratch sequence's slot. None where it cannot apply: the
    KV backend has no slot views (paged), or the native path already covers every batch size."""
    from xllm.core.sampling_params import SamplingParams
    from xllm.core.sequence import Sequence

    if not kv.addressing.slot_views:
        log.warning("compiled decode graphs need per-slot KV views (xtensor/contiguous); staying eager")
        return None
    low = runner.fused.max_batch + 1 if runner.fused is not None else 1
    if low > max_num_seqs:
        return None
    graph = CompiledDecode(model, kv, low, max_num_seqs)
    scratch = Sequence("__graph_warmup__", [0], SamplingParams(max_tokens=1), 0.0)
    if not kv.admit(scratch, 1):
        raise RuntimeError("no KV memory for the graph warm-up")
    try:
        graph.warmup(scratch.slot)
    finally:
        kv.free(scratch)
    return graph
