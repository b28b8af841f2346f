"""Beam rows across the ranks of a tensor-parallel instance (:mod:`xllm.core.executor`).

A beam step's rows (:class:`~xllm.core.beam.BeamRows`) attend through the beam module's own context
(:class:`~xllm.core.beam_attention.BeamAttention`): the group's prompt KV in the KV memory (every rank has its
own heads of it, at the same slot or pages) and each beam's decoded KV in the group's
:class:`~xllm.core.beam_attention.BeamKV`. A worker rank keeps a mirror of every live group's ``BeamKV`` with
its own KV heads (:class:`BeamMirror`); each forward with beam rows carries, for rank 0, their ids and
positions and per group (:func:`encode_beams`): its key, its buffer's shape, its rows, prompt (length, slot or
pages), the step's row in the buffer, and the reorder rank 0 made when it selected the last step's beams
(:attr:`BeamKV.reordered`: the worker applies it first, so its rows follow the same parents); and the keys
of the groups rank 0 has dropped since (:class:`BeamKeys`: their buffers are freed).

Beam rows ride in a ``STEP`` plan (after the batch's own rows, :func:`xllm.core.executor.plan.encode_step`) or,
in a forward of beam rows alone, a ``BEAM`` message (:data:`BEAM`), which every rank answers with the same
``model.forward`` and ``model.compute_logits`` over them (their collectives).
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from xllm.core.beam_attention import BeamAttention, BeamKV, GroupRows
from xllm.core.kv.contracts import KVTensors
from xllm.core.model_api import AttentionContext, CausalLM

BEAM = 18  # plan-channel kind: a forward of beam rows alone (after xllm.core.executor.kv_pages' kinds)
_GROUP_WORDS = 9  # key, width, max tokens, start, beams, prompt length, slot (-1: pages), step, pages


@dataclass
class MirroredRows:
    """A worker's :class:`~xllm.core.model_runner.ExtraRows`: rank 0's beam rows over this rank's heads (text
    models only: image models are not served with tensor parallelism)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: AttentionContext
    mrope_positions: torch.Tensor | None = None


class BeamKeys:
    """Rank 0's record of the groups the workers mirror: a group's buffer, once rank 0 drops it (garbage,
    on whatever thread), queues its key for the next message (:meth:`dead`)."""

    def __init__(self) -> None:
        self._known: set[int] = set()
        self._dead: collections.deque[int] = collections.deque()  # appended by finalizers (any thread)

    def sent(self, kv: BeamKV) -> None:
        """``kv`` is in a message: watch it (once)."""
        if kv.key not in self._known:
            self._known.add(kv.key)
            weakref.finalize(kv, self._dead.append, kv.key)

    def dead(self) -> list[int]:
        """The keys of the buffers dropped since the last call."""
        out = []
        while self._dead:
            key = self._dead.popleft()
            self._known.discard(key)
            out.append(key)
        return out


def encode_beams(input_ids: torch.Tensor, positions: torch.Tensor, groups: list[GroupRows],
                 keys: BeamKeys) -> np.ndarray:
    """Beam rows (and each group's pending reorder, taken from its buffer) as int64 words (module docstring)."""
    dead = keys.dead()
    ids = input_ids.to("cpu", torch.int64).numpy().reshape(-1)
    pos = positions.to("cpu", torch.int64).numpy().reshape(-1)
    parts = [np.array([len(ids), len(groups), len(dead), *dead], dtype=np.int64), ids, pos]
    for g in groups:
        keys.sent(g.kv)
        parents, length = g.kv.take_reordered()
        parts.append(np.array([g.kv.key, g.kv.k.shape[1], g.kv.k.shape[2], g.start, g.beams, g.prompt_len,
                               -1 if g.slot is None else g.slot, g.step, len(g.pages), *g.pages,
                               len(parents), length, *parents], dtype=np.int64))
    return np.concatenate(parts)


class BeamMirror:
    """A worker rank's buffers of rank 0's live beam groups, over its own KV heads of ``kv``."""

    def __init__(self, kv: KVTensors) -> None:
        self.kv = kv
        self.buffers: dict[int, BeamKV] = {}

    def rows(self, words: np.ndarray) -> MirroredRows:
        """The beam rows of a message's words (after applying its frees and the groups' reorders)."""
        w = [int(x) for x in words]
        n, ngroups, ndead = w[0], w[1], w[2]
        at = 3
        for key in w[at:at + ndead]:
            self.buffers.pop(key, None)
        at += ndead
        ids, pos = torch.tensor(w[at:at + n], dtype=torch.int64), torch.tensor(w[at + n:at + 2 * n], dtype=torch.int64)
        at += 2 * n
        spec, dtype = self.kv.layout.spec, self.kv.layout.dtype
        groups = []
        for _ in range(ngroups):
            key, width, max_tokens, start, beams, prompt_len, slot, step, npages = w[at:at + _GROUP_WORDS]
            at += _GROUP_WORDS
            pages = w[at:at + npages]
            at += npages
            nparents, length = w[at], w[at + 1]
            parents = w[at + 2:at + 2 + nparents]
            at += 2 + nparents
            buf = self.buffers.get(key)
            if buf is None:
                buf = self.buffers[key] = BeamKV(spec.num_layers, width, max_tokens, spec.num_kv_heads, spec.head_dim,
                                                 spec.v_head_dim, dtype, key=key)
            if parents:
                buf.reorder(torch.tensor(parents, dtype=torch.int64), length)
            groups.append(GroupRows(start, beams, prompt_len, None if slot < 0 else slot, pages, buf, step))
        if at != len(w):
            raise ValueError(f"beam rows: {len(w) - at} words left over")
        return MirroredRows(ids, pos, BeamAttention(self.kv, groups))

    @torch.inference_mode()
    def forward(self, words: np.ndarray, model: CausalLM) -> None:
        """A ``BEAM`` message: the beam rows' forward and logits (rank 0's collectives; the logits are rank 0's)."""
        rows = self.rows(words)
        model.compute_logits(model.forward(rows.input_ids, rows.positions, rows.ctx))
