"""A worker rank's side of ``--speculative self`` (the draft is the served model's first layers, with a KV
memory of its own): the draft's plans come as ``DRAFT_SETUP`` / ``DRAFT_STEP`` / ``DRAFT_OPS`` messages
(:mod:`xllm.core.executor.channel`) from rank 0's draft runner (a
:class:`~xllm.core.executor.runner.TensorParallelRunner` with ``draft_layers``), in the one order of the plan
channel with the served model's.

:meth:`DraftRank.build` takes the ``DRAFT_SETUP`` message: the view of this rank's shard's first
``draft_layers`` layers (the same weights, :meth:`~xllm.core.spec.base.SupportsLayerPrefix.layer_prefix`), its
KV memory (rank 0's draft layout over this rank's KV heads, mirroring rank 0's page mappings) and runner, and
the same agreements rank 0's draft runner makes; :meth:`DraftRank.serve` runs each later draft message.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from xllm.core.executor.channel import DRAFT_OPS, DRAFT_STEP, RankFailed
from xllm.core.executor.group import RankSetup, agree_capabilities, mirror_kv
from xllm.core.executor.kv_pages import agree_kv_heads
from xllm.core.executor.plan import decode_ops, decode_step
from xllm.core.model_api import CausalLM
from xllm.core.model_runner import ModelRunner
from xllm.core.parallel.comm import Communicator


@dataclass
class DraftRank:
    """This rank's draft: its model view, KV memory and runner, and the draft steps it ran."""

    kv: object
    runner: ModelRunner
    rank: int
    steps: int = 0

    @classmethod
    def build(cls, setup: RankSetup, model: CausalLM, comm: Communicator, device: torch.device) -> DraftRank:
        if setup.draft_layers < 1 or not hasattr(model, "layer_prefix"):
            raise RankFailed(f"rank {comm.rank}: a draft set-up of {setup.draft_layers} layers over "
                             f"{type(model).__name__}")
        draft = model.layer_prefix(setup.draft_layers)
        kv = mirror_kv(setup, draft.kv_cache_spec())
        try:
            runner = ModelRunner(draft, kv, device, native_decode=setup.native_decode)
            agree_capabilities(runner, comm)
            agree_kv_heads(draft, comm)
        except BaseException:
            kv.close()
            raise
        return cls(kv, runner, comm.rank)

    def serve(self, kind: int, words: np.ndarray) -> None:
        """A ``DRAFT_OPS`` or ``DRAFT_STEP`` message (the draft's mapping operations; one draft forward)."""
        if kind == DRAFT_OPS:
            self.kv.apply_mappings(decode_ops(words))  # type: ignore[attr-defined]
            return
        if kind != DRAFT_STEP:
            raise RankFailed(f"rank {self.rank}: unknown draft message kind {kind}")
        msg = decode_step(words, self.runner.device)
        if len(msg.kv_ops):
            self.kv.apply_mappings(msg.kv_ops)  # type: ignore[attr-defined]
        mode = self.runner.path(msg.batch)
        if mode != msg.mode:  # a different path calls different collectives: fail now, not deadlock
            raise RankFailed(f"rank {self.rank} would run draft step {self.steps} {mode}, rank 0 runs it {msg.mode}")
        self.runner.execute(msg.batch, greedy=msg.greedy)
        self.steps += 1

    def close(self) -> None:
        self.kv.close()  # type: ignore[attr-defined]
