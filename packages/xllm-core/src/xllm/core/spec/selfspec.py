"""Self-speculation (``--speculative self``): the target model's own first ``N`` decoder layers,
then its final norm and LM head, draft greedily (``--speculative-self-layers N``; default a quarter
of the layers, at least 1).

The draft is a *truncated view* of the target (:meth:`SupportsLayerPrefix.layer_prefix
<xllm.core.spec.base.SupportsLayerPrefix.layer_prefix>`): the same weight tensors, no copy, so it
costs only a KV cache for its ``N`` layers. That is the simplest honest design: no layer is
trained to be read early, so acceptance is whatever the early layers' guess is worth on the model
at hand (the adaptive ``k`` and back-off of :mod:`xllm.core.spec.speculator` keep it from costing
where it is low). It runs through the draft-model machinery (:mod:`xllm.core.spec.shadow`), with
the fused native steps where the target has them.
"""

from __future__ import annotations

from xllm.core.spec.base import ProposerContext, SupportsLayerPrefix
from xllm.core.spec.shadow import ShadowDrafter
from xllm.engine_api.errors import ConfigError


def default_self_layers(num_layers: int) -> int:
    """A quarter of the target's layers, at least 1."""
    return max(1, num_layers // 4)


class SelfProposer(ShadowDrafter):
    """:class:`~xllm.core.spec.base.Proposer` drafting with the first layers of ``ctx.target``."""

    def __init__(self, ctx: ProposerContext, catchup_tokens: int | None = None) -> None:
        target = ctx.target
        if not isinstance(target, SupportsLayerPrefix):
            raise ConfigError(f"--speculative self: the served model ({type(target).__name__}) cannot lend a "
                              "view of its first layers")
        total = target.kv_cache_spec().num_layers
        n = ctx.config.speculative_self_layers or default_self_layers(total)
        if not 1 <= n <= total:
            raise ConfigError(f"--speculative-self-layers must be in 1..{total} (the model's layers), got {n}")
        self.num_layers = n
        super().__init__(ctx, target.layer_prefix(n), catchup_tokens=catchup_tokens)
