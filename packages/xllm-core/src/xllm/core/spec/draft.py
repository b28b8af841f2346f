"""A draft model (``--speculative draft --draft-model DIR``): a smaller model with the target's
tokenizer proposes ``k`` tokens greedily (so its ``q`` is a point mass: xllm.core.spec.verify),
from a KV cache of its own.

Each target sequence has a shadow :class:`~xllm.core.sequence.Sequence` here: the same prompt, the
target's output so far plus the drafts of the step, and how many of those tokens the draft's KV
holds. A proposal catches the shadow up (one chunk over the tokens the draft has not seen: the
prompt at first, later the target's last tokens) and then decodes one token per round; sequences
of one step are batched in each round. When the target's output arrives, the shadow keeps the KV of
its tokens that equal the target's (the accepted drafts) and drops the rest (overwritten next
time). A shadow's KV goes when its sequence finishes; a target preemption does not touch it.
"""

from __future__ import annotations

import torch

from xllm.core.kv.base import KVCacheBackend, build_kv_cache
from xllm.core.model_runner import ModelRunner
from xllm.core.sequence import Sequence
from xllm.core.spec.base import ProposerContext
from xllm.kernels.sampling import argmax_rows


class DraftProposer:
    """:class:`~xllm.core.spec.base.Proposer` running ``ctx.draft_model``."""

    def __init__(self, ctx: ProposerContext) -> None:
        if ctx.draft_model is None:
            raise ValueError("the draft proposer needs a draft model")
        cfg = ctx.config
        self.model = ctx.draft_model
        spec = self.model.kv_cache_spec()
        # the target's KV memory budget again (a smaller model's rows hold more tokens in it)
        self.kv: KVCacheBackend = build_kv_cache(
            cfg.kv_cache_backend, spec, cfg.dtype, ctx.device, cfg.max_num_seqs, ctx.max_model_len,
            cfg.kv_cache_memory_gib, cfg.block_size, enable_prefix_cache=False)
        self.runner = ModelRunner(self.model, self.kv, ctx.device, native_decode=cfg.native_decode)
        self._shadows: dict[Sequence, Sequence] = {}

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts: dict[Sequence, list[int]] = {seq: [] for seq, _ in requests}
        want = {seq: k for seq, k in requests}
        active: list[Sequence] = []
        for seq, k in requests:
            shadow = self._sync(seq)
            if shadow is not None and self._room(shadow, k):
                active.append(seq)
        first = True
        while active:
            chunks = []
            for seq in active:
                shadow = self._shadows[seq]
                chunks.append((shadow, shadow.num_tokens - shadow.num_computed_tokens if first else 1))
            tokens = self._forward(chunks)
            first = False
            still = []
            for seq, token in zip(active, tokens, strict=True):
                shadow = self._shadows[seq]
                shadow.output_ids.append(token)
                drafts[seq].append(token)
                if len(drafts[seq]) < want[seq]:
                    still.append(seq)
            active = still
        return [drafts[seq] for seq, _ in requests]

    def _sync(self, seq: Sequence) -> Sequence | None:
        """The shadow of ``seq`` with the target's tokens, its KV valid for their common prefix."""
        shadow = self._shadows.get(seq)
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.prompt_ids, seq.params, seq.arrival_time)
            if self.kv.admit(shadow, 1) < 1:  # a slot and a first page; the rest in _room
                return None
            shadow.num_computed_tokens = 0
            self._shadows[seq] = shadow
        target, out = seq.output_ids, shadow.output_ids
        # the shadow's output is the target's as of the last proposal plus that proposal's drafts
        # (at most 16): only the tail can differ
        limit = min(len(out), len(target))
        same = max(0, limit - 32)
        while same < limit and out[same] == target[same]:
            same += 1
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, len(shadow.prompt_ids) + same)
        del out[same:]
        out.extend(target[same:])
        return shadow

    def _room(self, shadow: Sequence, k: int) -> bool:
        """KV for the catch-up chunk and k - 1 draft rounds (the last draft is not fed back)."""
        return self.kv.allocate(shadow, shadow.num_tokens - shadow.num_computed_tokens + k - 1)

    @torch.inference_mode()
    def _forward(self, chunks: list[tuple[Sequence, int]]) -> list[int]:
        """One draft forward over ``chunks`` (decode rows first, as the runner packs them); the greedy
        next token of each chunk's sequence, in ``chunks`` order."""
        def is_decode(i: int) -> bool:
            return chunks[i][1] == 1 and chunks[i][0].num_computed_tokens > 0

        order = sorted(range(len(chunks)), key=lambda i: not is_decode(i))
        packed = [chunks[i] for i in order]
        batch = self.runner.prepare(packed)
        logits = self.runner.execute(batch)
        chosen = argmax_rows(logits.float()).tolist()
        for shadow, n in packed:
            shadow.num_computed_tokens += n
        by_seq = {id(s): t for s, t in zip(batch.sample_seqs, chosen, strict=True)}
        return [by_seq[id(shadow)] for shadow, _ in chunks]

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq, None)
        if shadow is not None:
            self.kv.free(shadow)

    def close(self) -> None:
        for shadow in self._shadows.values():
            self.kv.free(shadow)
        self._shadows.clear()
        self.kv.close()
