"""The machinery of the model-backed proposers (``draft``, ``self``, ``mtp``): a model with a KV
cache of its own that follows each target sequence through a *shadow* sequence and drafts greedily
(so its ``q`` is a point mass: :mod:`xllm.core.spec.verify`).

Each target sequence has a shadow :class:`~xllm.core.sequence.Sequence` here: the target's tokens
from index ``shift`` on (``shift`` = 0 for a draft model; 1 for MTP, whose position ``i`` reads the
token ``i + 1``), the target's output so far plus the drafts of the last proposal, and how many of
those tokens the shadow's KV holds. A proposal

1. syncs the shadow: it keeps the KV of the tokens that equal the target's (the accepted drafts)
   and of at most :meth:`ShadowDrafter.valid_computed` positions, and drops the rest (overwritten);
2. catches the shadow up over the tokens its KV does not hold (the prompt at first, later the
   target's last tokens), **chunked**: one proposal computes at most ``catchup_tokens`` catch-up
   tokens over all its sequences (default: the engine's step token budget), the sequences that are
   furthest behind last, so a long prompt never makes one step's proposal a whole prefill; a shadow
   still behind after its chunk drafts nothing this step (its sequence decodes as usual) and goes
   on from there next step;
3. decodes one greedy token per round for the shadows that caught up, batched over the sequences
   of the step, until each has its ``k`` drafts.

A shadow's KV goes when its sequence finishes; a target preemption does not touch it.
"""

from __future__ import annotations

import torch

from xllm.core.kv.base import KVCacheBackend, build_kv_cache
from xllm.core.model_api import CausalLM, KVCacheSpec
from xllm.core.model_runner import BatchInputs, ModelRunner
from xllm.core.sequence import Sequence
from xllm.core.spec.base import ProposerContext
from xllm.kernels.sampling import argmax_rows

TAIL = 32  # a shadow's output differs from its target's in at most its last drafts (<= 16)


class ShadowDrafter:
    """Base of the :class:`~xllm.core.spec.base.Proposer` s that draft with a model of their own.

    ``model`` runs through a :class:`~xllm.core.model_runner.ModelRunner` over a KV backend built
    for ``kv_spec`` (the target's KV memory budget again: a smaller model's rows hold more tokens
    in it), without a prefix cache. Subclasses say how a packed draft forward runs (:meth:`run`)
    and which shadow KV stays valid (:meth:`valid_computed`).
    """

    shift = 0  # the shadow's token i is the target's token i + shift

    def __init__(self, ctx: ProposerContext, model: CausalLM, kv_spec: KVCacheSpec | None = None,
                 catchup_tokens: int | None = None) -> None:
        cfg = ctx.config
        self.model = model
        self.kv: KVCacheBackend = build_kv_cache(
            cfg.kv_cache_backend, kv_spec or model.kv_cache_spec(), cfg.dtype, ctx.device, cfg.max_num_seqs,
            ctx.max_model_len, cfg.kv_cache_memory_gib, cfg.block_size, enable_prefix_cache=False)
        self.runner = ModelRunner(model, self.kv, ctx.device, native_decode=cfg.native_decode)
        self.catchup_tokens = catchup_tokens if catchup_tokens is not None else cfg.max_num_batched_tokens
        if self.catchup_tokens < 1:
            raise ValueError(f"catchup_tokens must be >= 1, got {self.catchup_tokens}")
        self._shadows: dict[Sequence, Sequence] = {}  # target -> shadow
        self._target: dict[Sequence, Sequence] = {}   # shadow -> target

    # ---- the Proposer contract --------------------------------------------------------------
    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts: dict[Sequence, list[int]] = {seq: [] for seq, _ in requests}
        want = {seq: k for seq, k in requests}
        behind: list[tuple[int, int, Sequence]] = []
        for i, (seq, _) in enumerate(requests):
            shadow = self._sync(seq)
            if shadow is not None:
                behind.append((shadow.num_tokens - shadow.num_computed_tokens, i, seq))
        budget = self.catchup_tokens
        chunks: list[tuple[Sequence, int]] = []
        for n, _, seq in sorted(behind, key=lambda b: b[:2]):  # the least behind first
            if budget < 1:
                break
            shadow = self._shadows[seq]
            n = min(n, budget)
            caught_up = shadow.num_computed_tokens + n == shadow.num_tokens
            if self.kv.allocate(shadow, n + (want[seq] - 1 if caught_up else 0)):
                chunks.append((shadow, n))
                budget -= n
        first = True
        while chunks:
            tokens = self._forward(chunks, first)
            first = False
            nxt = []
            for shadow, _ in chunks:
                token = tokens.get(shadow)
                if token is None:  # a partial catch-up chunk: no draft this step
                    continue
                seq = self._target[shadow]
                shadow.output_ids.append(token)
                drafts[seq].append(token)
                if len(drafts[seq]) < want[seq]:
                    nxt.append((shadow, 1))
            chunks = nxt
        return [drafts[seq] for seq, _ in requests]

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq, None)
        if shadow is not None:
            del self._target[shadow]
            self.kv.free(shadow)
            self.forget(shadow)

    def close(self) -> None:
        for shadow in self._shadows.values():
            self.kv.free(shadow)
            self.forget(shadow)
        self._shadows.clear()
        self._target.clear()
        self.kv.close()

    # ---- what subclasses refine -------------------------------------------------------------
    def valid_computed(self, seq: Sequence, shadow: Sequence) -> int:
        """An upper bound on the shadow tokens whose KV stays valid once synced with ``seq``."""
        return shadow.num_computed_tokens

    def run(self, batch: BatchInputs, chunks: list[tuple[Sequence, int]], first: bool) -> torch.Tensor:
        """The logits of ``batch`` (packed from the shadows' ``chunks``, in that order); ``first``:
        the catch-up round (later rounds feed each shadow its last draft)."""
        return self.runner.execute(batch)

    def forget(self, shadow: Sequence) -> None:
        """``shadow`` is gone: drop whatever a subclass keeps for it."""

    # ---- the shadows ------------------------------------------------------------------------
    def _sync(self, seq: Sequence) -> Sequence | None:
        """The shadow of ``seq`` with the target's tokens, its KV valid for their common prefix."""
        shadow = self._shadows.get(seq)
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.prompt_ids[self.shift:], seq.params, seq.arrival_time)
            shadow.output_ids = list(seq.output_ids)
            if self.kv.admit(shadow, 1) < 1:  # a slot and a first page; the rest in propose
                return None
            shadow.num_computed_tokens = 0
            self._shadows[seq] = shadow
            self._target[shadow] = seq
        target, out = seq.output_ids, shadow.output_ids
        limit = min(len(out), len(target))
        same = max(0, limit - TAIL)
        while same < limit and out[same] == target[same]:
            same += 1
        del out[same:]
        out.extend(target[same:])
        # the last token is always (re)computed: its logits give the first draft
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, shadow.num_prompt_tokens + same,
                                         self.valid_computed(seq, shadow), shadow.num_tokens - 1)
        return shadow

    @torch.inference_mode()
    def _forward(self, chunks: list[tuple[Sequence, int]], first: bool) -> dict[Sequence, int]:
        """One draft forward over the shadows' ``chunks``; the greedy next token of each chunk that
        reaches its shadow's last token (a partial catch-up chunk has none)."""
        def is_decode(i: int) -> bool:
            shadow, n = chunks[i]
            return n == 1 and shadow.num_computed_tokens > 0 and shadow.num_computed_tokens + 1 == shadow.num_tokens

        packed = [chunks[i] for i in sorted(range(len(chunks)), key=lambda i: not is_decode(i))]
        batch = self.runner.prepare(packed)
        logits = self.run(batch, packed, first)
        for shadow, n in packed:
            shadow.num_computed_tokens += n
        if not batch.sample_seqs:
            return {}
        chosen = argmax_rows(logits.float()).tolist()
        return dict(zip(batch.sample_seqs, chosen, strict=True))
