"""Rank 0's model runner of a tensor-parallel instance: every step's plan goes to the worker ranks, then
rank 0 runs its own shard's forward (whose collectives the workers join).

With one rank the engine holds a plain :class:`~xllm.core.model_runner.ModelRunner` (nothing of this
module runs). :class:`TensorParallelRunner` is a ``ModelRunner`` whose :meth:`execute` first publishes
the step plan (:mod:`xllm.core.executor.plan`: the batch, the path it takes, ``greedy`` and the xTensor
mappings made since the last step) on the plan channel, then runs the same ``execute`` on rank 0's
shard. A rank that died or stopped answering, before or during the forward, raises
:class:`~xllm.core.executor.channel.RankFailed` from :meth:`execute` (the engine loop dies of it and the
instance stops serving).

KV hand-offs and the KV tiers read and write the instance's pages through
:meth:`TensorParallelRunner.transfer_store` (every rank's KV heads in the canonical layout,
:mod:`xllm.core.executor.kv_pages`); one lock orders every publish-then-collectives sequence (a step, a beam
forward, a page read, a page write) the same on every rank. A thread holding it never waits for another
thread that may wait for it (a step's forward waits for nothing else; page reads and writes come from the
engine, loader and hand-off threads between steps), so none deadlocks.

Expert parallelism (a model with an ``expert_plane``): :attr:`TensorParallelRunner.eplb` closes the MoE load
windows and switches the expert placement between steps (:mod:`xllm.core.eplb`).

Beam rows (:mod:`xllm.core.beam_mirror`): a step's (``extra``) ride in its plan, a forward of beam rows alone
(:meth:`TensorParallelRunner.forward_beams`) is a ``BEAM`` message; each worker mirrors the groups' beam KV
with its own heads.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from xllm.core.beam_mirror import BEAM, BeamKeys, encode_beams
from xllm.core.eplb import EplbController, EplbSettings
from xllm.core.executor.channel import DRAFT_OPS, DRAFT_SETUP, DRAFT_STEP, OPS, SETUP, STEP, RankFailed
from xllm.core.executor.group import RankGroup, RankSetup, agree_capabilities
from xllm.core.executor.kv_pages import KVHeads, ShardedPageStore, agree_kv_heads
from xllm.core.executor.plan import HEADER_WORDS, OP_WORDS, encode_ops, encode_step
from xllm.core.kv.contracts import KVTensors
from xllm.core.kv.layout import KVCacheLayout
from xllm.core.model_api import CausalLM
from xllm.core.model_runner import BatchInputs, ExtraRows, ModelRunner
from xllm.core.parallel.comm import CollectiveError

if TYPE_CHECKING:
    from xllm.core.beam import BeamRows

LOAD_TIMEOUT_S = 3600.0  # how long rank 0 waits for a live worker to load its shard


@dataclass(frozen=True)
class Stream:
    """The message kinds of one runner's plans: the served model's, or the ``self`` draft's."""

    setup: int
    step: int
    ops: int


MAIN = Stream(SETUP, STEP, OPS)
DRAFT = Stream(DRAFT_SETUP, DRAFT_STEP, DRAFT_OPS)


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner over ``group``'s ranks (see the module docstring). Building it sends the workers
    the KV layout (``SETUP``) and agrees with them on the paths every rank may take
    (:func:`~xllm.core.executor.group.agree_capabilities`) and every rank's KV heads
    (:func:`~xllm.core.executor.kv_pages.agree_kv_heads`); :meth:`close` stops the workers.

    ``draft_layers`` > 0: the runner of ``--speculative self``'s draft (``model`` is rank 0's view of its
    shard's first ``draft_layers`` layers, ``kv`` the draft's own KV memory): its plans are ``DRAFT_*``
    messages (each worker builds the same view and memory, :mod:`xllm.core.executor.draft_rank`) under the
    served model's runner's ``lock`` (one order of everything on the channel); closing it stops nothing."""

    def __init__(self, model: CausalLM, kv: KVTensors, device: torch.device, group: RankGroup,
                 native_decode: bool = True, lock: threading.Lock | None = None, draft_layers: int = 0,
                 eplb: EplbSettings | None = None) -> None:
        super().__init__(model, kv, device, native_decode)
        self.group = group
        self.stream = DRAFT if draft_layers else MAIN
        # held by every publish-then-collectives sequence (module docstring)
        self.lock = lock if lock is not None else threading.Lock()
        self._transfer: ShardedPageStore | None = None
        self._beam_keys = BeamKeys()  # the beam groups the workers mirror
        self.beam_forwards = 0  # forwards of beam rows alone (forward_beams)
        self._executing: int | None = None  # the thread inside execute's forward (its nested call runs plain)
        self._mirror = hasattr(kv, "record_mappings")
        if self._mirror:
            kv.record_mappings()  # type: ignore[attr-defined]
        setup = RankSetup(type(kv), kv.layout, native_decode, draft_layers)  # type: ignore[attr-defined]
        with self.lock:
            seq = group.channel.publish(self.stream.setup, pickle.dumps(setup), group.timeout_s, group.check)
            # a worker takes the set-up once its shard is loaded: as long as that takes (it is alive: group.check)
            group.channel.wait_acked(seq, LOAD_TIMEOUT_S, group.check)
            try:
                agree_capabilities(self, group.comm)
                self.kv_heads: KVHeads = agree_kv_heads(model, group.comm)
            except CollectiveError as e:
                raise group.failure(e) from e
        plane = getattr(model, "expert_plane", None) if not draft_layers else None
        # expert parallelism: the load windows and placement switches (xllm.core.eplb), around every step
        self.eplb = EplbController(plane, group, eplb or EplbSettings()) if plane is not None else None

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

    def _publish_ops(self, ops: np.ndarray) -> None:
        g = self.group
        per = max(1, (g.channel.spec.slot_bytes // 8 - HEADER_WORDS) // OP_WORDS)
        for i in range(0, len(ops), per):
            g.channel.publish(self.stream.ops, encode_ops(ops[i:i + per]), g.timeout_s, g.check)

    def publish(self, batch: BatchInputs, greedy: bool, beams: np.ndarray | None = None) -> str:
        """Send ``batch``'s plan (and the words of beam rows riding after its rows) to every worker (after any
        KV mapping operations that did not fit it); the path it takes."""
        g = self.group
        g.check()
        mode = self.path(batch)
        ops = self._kv_ops()
        msg = encode_step(batch, mode, greedy, ops, beams)
        if msg.nbytes > g.channel.spec.slot_bytes and len(ops):
            self._publish_ops(ops)
            msg = encode_step(batch, mode, greedy, beams=beams)
        g.channel.publish(self.stream.step, msg, g.timeout_s, g.check)
        return mode

    def execute(self, batch: BatchInputs, on_layer: Callable[[int], None] | None = None,
                extra: ExtraRows | None = None, greedy: bool = False) -> torch.Tensor:
        """:meth:`ModelRunner.execute` on every rank: the plan to the workers, then rank 0's forward. ``extra``:
        a :class:`~xllm.core.beam.BeamRows` (the workers mirror its groups)."""
        if self._executing == threading.get_ident():  # ModelRunner.execute's own rows of a step with extra rows:
            # a worker's runner makes the same call, without an overlap chooser (its "eager" for rank 0's "overlap")
            mode = self.path(batch, listening=on_layer is not None)
            return super().execute(batch, on_layer, extra, greedy, mode="eager" if mode == "overlap" else mode)
        if self.hidden_sink is not None:
            raise NotImplementedError("--tensor-parallel-size > 1 runs no hidden-state sinks (mtp)")
        if extra is not None and not hasattr(extra, "rows"):
            raise NotImplementedError(f"--tensor-parallel-size > 1 runs beam rows only as extra rows, not "
                                      f"{type(extra).__name__}")
        with self.lock:
            try:
                beams = None if extra is None else encode_beams(extra.input_ids, extra.positions,
                                                                extra.rows, self._beam_keys)  # type: ignore[attr-defined]
                if self.eplb is not None:
                    self.eplb.before_step()
                mode = self.publish(batch, greedy, beams)
                self._executing = threading.get_ident()
                if extra is not None:
                    out = super().execute(batch, extra=extra)
                else:
                    out = super().execute(batch, greedy=greedy, mode=mode)
                if self.eplb is not None:
                    self.eplb.after_step()
            except CollectiveError as e:
                raise self.group.failure(e) from e
            finally:
                self._executing = None
        if on_layer is not None:  # a page read waits for the lock: every layer is readable once the forward ends
            for layer in range(self.kv.layout.spec.num_layers):  # type: ignore[attr-defined]
                on_layer(layer)
        return out

    @torch.inference_mode()
    def forward_beams(self, rows: BeamRows) -> torch.Tensor:
        """The logits of beam rows in a forward of their own, on every rank (:class:`~xllm.core.beam.BeamRunner`'s
        ``forward``)."""
        g = self.group
        with self.lock:
            try:
                g.check()
                beams = encode_beams(rows.input_ids, rows.positions, rows.rows, self._beam_keys)
                ops = self._kv_ops()  # (the workers' slots show rank 0's pages before the forward reads them)
                if len(ops):
                    self._publish_ops(ops)
                g.channel.publish(BEAM, beams, g.timeout_s, g.check)
                self.beam_forwards += 1
                return self.model.compute_logits(self.model.forward(rows.input_ids, rows.positions, rows.ctx))
            except CollectiveError as e:
                raise g.failure(e) from e

    def close(self) -> None:
        """Stop the worker ranks and leave the group (idempotent; a draft's runner: nothing)."""
        if self.stream is not MAIN:
            return
        with self.lock:
            self.group.close()


__all__ = ["RankFailed", "TensorParallelRunner"]
