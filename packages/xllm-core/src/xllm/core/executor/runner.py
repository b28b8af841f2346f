"""Rank 0's model runner of a tensor-parallel instance: every step's plan goes to the worker ranks, then
rank 0 runs its own shard's forward (whose collectives the workers join).

With one rank the engine holds a plain :class:`~xllm.core.model_runner.ModelRunner` (nothing of this
module runs). :class:`TensorParallelRunner` is a ``ModelRunner`` whose :meth:`execute` first publishes
the step plan (:mod:`xllm.core.executor.plan`: the batch, the path it takes, ``greedy`` and the xTensor
mappings made since the last step) on the plan channel, then runs the same ``execute`` on rank 0's
shard. A rank that died or stopped answering, before or during the forward, raises
:class:`~xllm.core.executor.channel.RankFailed` from :meth:`execute` (the engine loop dies of it and the
instance stops serving).

KV hand-offs read and write the instance's pages through :meth:`TensorParallelRunner.transfer_store` (every
rank's KV heads in the canonical layout, :mod:`xllm.core.executor.kv_pages`); one lock orders every
publish-then-collectives sequence (a step, a page read, a page write) the same on every rank.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
from collections.abc import Callable

import numpy as np
import torch

from xllm.core.executor.channel import OPS, SETUP, STEP, RankFailed
from xllm.core.executor.group import RankGroup, RankSetup, agree_capabilities
from xllm.core.executor.kv_pages import KVHeads, ShardedPageStore, agree_kv_heads
from xllm.core.executor.plan import HEADER_WORDS, OP_WORDS, encode_ops, encode_step
from xllm.core.kv.contracts import KVTensors
from xllm.core.kv.layout import KVCacheLayout
from xllm.core.model_api import CausalLM
from xllm.core.model_runner import BatchInputs, ExtraRows, ModelRunner
from xllm.core.parallel.comm import CollectiveError

LOAD_TIMEOUT_S = 3600.0  # how long rank 0 waits for a live worker to load its shard


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner over ``group``'s ranks (see the module docstring). Building it sends the workers
    the KV layout (``SETUP``) and agrees with them on the paths every rank may take
    (:func:`~xllm.core.executor.group.agree_capabilities`) and every rank's KV heads
    (:func:`~xllm.core.executor.kv_pages.agree_kv_heads`); :meth:`close` stops the workers."""

    def __init__(self, model: CausalLM, kv: KVTensors, device: torch.device, group: RankGroup,
                 native_decode: bool = True) -> None:
        super().__init__(model, kv, device, native_decode)
        self.group = group
        self.lock = threading.Lock()  # held by every publish-then-collectives sequence (module docstring)
        self._transfer: ShardedPageStore | None = None
        self._mirror = hasattr(kv, "record_mappings")
        if self._mirror:
            kv.record_mappings()  # type: ignore[attr-defined]
        setup = RankSetup(type(kv), kv.layout, native_decode)  # type: ignore[attr-defined]
        seq = group.channel.publish(SETUP, pickle.dumps(setup), group.timeout_s, group.check)
        # a worker takes the set-up once its shard is loaded: as long as that takes (it is alive: group.check)
        group.channel.wait_acked(seq, LOAD_TIMEOUT_S, group.check)
        try:
            agree_capabilities(self, group.comm)
            self.kv_heads: KVHeads = agree_kv_heads(model, group.comm)
        except CollectiveError as e:
            raise group.failure(e) from e

    @property
    def transfer_layout(self) -> KVCacheLayout:
        """The KV layout hand-offs speak: rank 0's with every rank's KV heads (a one-rank instance's)."""
        layout = self.kv.layout  # type: ignore[attr-defined]
        return dataclasses.replace(layout, spec=dataclasses.replace(layout.spec, num_kv_heads=self.kv_heads.total))

    def transfer_store(self) -> ShardedPageStore | None:
        """Every rank's KV pages in the canonical layout (:mod:`xllm.core.executor.kv_pages`); None for a
        backend without pages or quantized KV rows (which are not resharded)."""
        if self._transfer is None:
            local = self.kv.page_store()  # type: ignore[attr-defined]
            layout = self.transfer_layout
            if local is None or layout.quantized:
                return None
            self._transfer = ShardedPageStore(self.group, self.lock, local, self.kv_heads, layout.block_size,
                                              layout.fingerprint)
        return self._transfer

    def _kv_ops(self) -> np.ndarray:
        ops = self.kv.drain_mappings() if self._mirror else []  # type: ignore[attr-defined]
        return np.asarray(ops, dtype=np.int64).reshape(-1, OP_WORDS)

    def publish(self, batch: BatchInputs, greedy: bool) -> str:
        """Send ``batch``'s plan to every worker (after any KV mapping operations that did not fit it);
        the path it takes."""
        g = self.group
        g.check()
        mode = self.path(batch)
        ops = self._kv_ops()
        msg = encode_step(batch, mode, greedy, ops)
        if msg.nbytes > g.channel.spec.slot_bytes and len(ops):
            per = max(1, (g.channel.spec.slot_bytes // 8 - HEADER_WORDS) // OP_WORDS)
            for i in range(0, len(ops), per):
                g.channel.publish(OPS, encode_ops(ops[i:i + per]), g.timeout_s, g.check)
            msg = encode_step(batch, mode, greedy)
        g.channel.publish(STEP, msg, g.timeout_s, g.check)
        return mode

    def execute(self, batch: BatchInputs, on_layer: Callable[[int], None] | None = None,
                extra: ExtraRows | None = None, greedy: bool = False) -> torch.Tensor:
        """:meth:`ModelRunner.execute` on every rank: the plan to the workers, then rank 0's forward."""
        if extra is not None or self.hidden_sink is not None:
            raise NotImplementedError("--tensor-parallel-size > 1 runs no beam rows or hidden-state sinks (mtp)")
        with self.lock:
            try:
                self.publish(batch, greedy)
                out = super().execute(batch, greedy=greedy)
            except CollectiveError as e:
                raise self.group.failure(e) from e
        if on_layer is not None:  # a page read waits for the lock: every layer is readable once the forward ends
            for layer in range(self.kv.layout.spec.num_layers):  # type: ignore[attr-defined]
                on_layer(layer)
        return out

    def close(self) -> None:
        """Stop the worker ranks and leave the group (idempotent)."""
        with self.lock:
            self.group.close()


__all__ = ["RankFailed", "TensorParallelRunner"]
