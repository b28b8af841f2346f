"""A draft model (``--speculative draft --draft-model DIR``): a smaller model with the target's
tokenizer proposes ``k`` tokens greedily from a KV cache of its own (the shadow-sequence machinery
of :mod:`xllm.core.spec.shadow`: chunked catch-up, then batched greedy rounds)."""

from __future__ import annotations

from xllm.core.spec.base import ProposerContext
from xllm.core.spec.shadow import ShadowDrafter


class DraftProposer(ShadowDrafter):
    """:class:`~xllm.core.spec.base.Proposer` running ``ctx.draft_model``."""

    def __init__(self, ctx: ProposerContext, catchup_tokens: int | None = None) -> None:
        if ctx.draft_model is None:
            raise ValueError("the draft proposer needs a draft model")
        super().__init__(ctx, ctx.draft_model, catchup_tokens=catchup_tokens)
