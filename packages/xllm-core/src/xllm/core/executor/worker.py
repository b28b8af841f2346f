"""A worker rank's loop: take rank 0's step plans and run the same forward on this rank's shard.

:func:`serve_rank` runs in the worker process once its model shard is loaded and it joined the group
(:mod:`xllm.engine.ranks` starts it; the core never imports a model): it builds its KV memory from rank
0's ``SETUP`` (same layout, its own KV heads; :func:`~xllm.core.executor.group.mirror_kv`), agrees the
paths with the other ranks, then per ``STEP`` message applies rank 0's KV mapping operations, checks it
takes rank 0's path and executes; ``KV_READ`` / ``KV_WRITE`` move its KV heads of some pages for a hand-off
(:mod:`xllm.core.executor.kv_pages`); ``BEAM`` runs beam rows alone (:mod:`xllm.core.beam_mirror`);
``EPLB_*`` switch the expert placement (:mod:`xllm.core.eplb`); ``DRAFT_*`` run the ``self`` draft
(:mod:`xllm.core.executor.draft_rank`); ``SHUTDOWN`` ends it. Rank 0's death (the plan
channel's liveness check) or a failed collective ends it with :class:`~xllm.core.executor.channel.RankFailed`.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable

import numpy as np
import torch

from xllm.core.beam_mirror import BEAM, BeamMirror
from xllm.core.eplb import EPLB_COMMIT, EPLB_PREPARE, serve_eplb_message
from xllm.core.executor.channel import (
    DRAFT_OPS,
    DRAFT_SETUP,
    DRAFT_STEP,
    OPS,
    SETUP,
    SHUTDOWN,
    STEP,
    RankFailed,
    StepChannel,
)
from xllm.core.executor.draft_rank import DraftRank
from xllm.core.executor.group import RankSetup, agree_capabilities, mirror_kv
from xllm.core.executor.kv_pages import KV_READ, KV_WRITE, agree_kv_heads, serve_kv_message
from xllm.core.executor.plan import decode_ops, decode_step
from xllm.core.model_api import CausalLM
from xllm.core.model_runner import ModelRunner
from xllm.core.parallel.comm import Communicator

log = logging.getLogger(__name__)


def parent_alive(parent_pid: int) -> Callable[[], bool]:
    """Whether the process that started this one still runs (its children are re-parented when it dies)."""
    return lambda: os.getppid() == parent_pid


def serve_rank(model: CausalLM, comm: Communicator, channel: StepChannel, device: torch.device,
               alive: Callable[[], bool]) -> int:
    """Run rank ``comm.rank``'s side of every step until ``SHUTDOWN``; the steps it ran."""
    kind, payload = channel.receive(alive)
    if kind == SHUTDOWN:
        return 0
    if kind != SETUP:
        raise RankFailed(f"rank {comm.rank}: expected the set-up message, got kind {kind}")
    setup: RankSetup = pickle.loads(payload)
    kv = mirror_kv(setup, model.kv_cache_spec())
    steps = 0
    draft: DraftRank | None = None
    try:
        runner = ModelRunner(model, kv, device, native_decode=setup.native_decode)
        agree_capabilities(runner, comm)
        heads = agree_kv_heads(model, comm)
        pages = None  # this rank's KV pages, opened at the first hand-off
        beams = BeamMirror(kv)  # rank 0's beam groups' KV, this rank's heads (xllm.core.beam_mirror)
        while True:
            kind, payload = channel.receive(alive)
            if kind == SHUTDOWN:
                return steps
            if kind == DRAFT_SETUP:  # --speculative self (xllm.core.executor.draft_rank)
                draft = DraftRank.build(pickle.loads(payload), model, comm, device)
                continue
            words = np.frombuffer(payload, dtype=np.int64)
            if kind == OPS:
                kv.apply_mappings(decode_ops(words))
                continue
            if kind == BEAM:
                beams.forward(words, model)
                continue
            if kind in (DRAFT_STEP, DRAFT_OPS):
                draft.serve(kind, words)  # type: ignore[union-attr]  (a DRAFT_SETUP came first)
                continue
            if kind in (EPLB_PREPARE, EPLB_COMMIT):  # expert placement switches (xllm.core.eplb)
                serve_eplb_message(kind, words, getattr(model, "expert_plane", None), comm)
                continue
            if kind in (KV_READ, KV_WRITE):
                if pages is None:
                    pages = kv.page_store()
                serve_kv_message(kind, words, pages, heads, comm, kv.layout.block_size)
                continue
            if kind != STEP:
                raise RankFailed(f"rank {comm.rank}: unknown message kind {kind}")
            msg = decode_step(words, device)
            if len(msg.kv_ops):
                kv.apply_mappings(msg.kv_ops)
            mode = runner.path(msg.batch)
            # a different path calls different collectives: fail now, not deadlock (rank 0's chooser may
            # overlap an eager step: xllm.core.overlap)
            if mode != msg.mode and (mode, msg.mode) != ("eager", "overlap"):
                raise RankFailed(f"rank {comm.rank} would run step {steps} {mode}, rank 0 runs it {msg.mode}")
            if msg.beams is not None:
                runner.execute(msg.batch, extra=beams.rows(msg.beams))
            else:
                runner.execute(msg.batch, greedy=msg.greedy, mode=msg.mode)
            steps += 1
    finally:
        if draft is not None:
            draft.close()
        kv.close()
