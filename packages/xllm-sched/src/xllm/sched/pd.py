"""Placement for prefill/decode disaggregation (xLLM §3.2, RTP-LLM §3): a decode instance for the
request's whole life, and a prefill instance for its prompt.

The decode instance is chosen first, because it keeps the request: among the decode candidates
with room for the prompt and its tokens (``kv_free_tokens``), the one holding the longest prefix of
the prompt (that part is neither computed nor sent), then the least loaded, then the most free KV.
The prefill instance is chosen by a routing policy over the prefill candidates — by default the
KV-cache-aware one: predicted time to the first token (queued prefill work over measured speed)
traded against the prefix it holds. Pure logic: the gateway builds the snapshots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xllm.sched.routing import (
    InstanceSnapshot,
    KVCacheAwarePolicy,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
)


@dataclass(frozen=True)
class PDDecision:
    prefill: RouteDecision
    decode: RouteDecision


class PDPlacement:
    """Chooses a (prefill, decode) pair; ``prefill_policy`` ranks the prefill candidates."""

    def __init__(self, prefill_policy: RoutingPolicy | None = None, prefix_weight: float = 1.0,
                 load_weight: float = 1.0) -> None:
        self.prefill_policy = prefill_policy or KVCacheAwarePolicy()
        self.prefix_weight, self.load_weight = prefix_weight, load_weight

    def route(self, request: RouteRequest, prefills: Sequence[InstanceSnapshot],
              decodes: Sequence[InstanceSnapshot]) -> PDDecision:
        if not prefills or not decodes:
            raise ValueError("PD placement needs a prefill and a decode candidate")
        return PDDecision(self.prefill_policy.route(request, prefills), self.decode(request, decodes))

    def decode(self, request: RouteRequest, candidates: Sequence[InstanceSnapshot]) -> RouteDecision:
        need = request.num_prompt_tokens + request.max_new_tokens
        roomy = [c for c in candidates if c.kv_free_tokens < 0 or c.kv_free_tokens >= need]
        pool = sorted(roomy or candidates, key=lambda c: c.instance_id)
        length = max(request.num_prompt_tokens, 1)
        busiest = max(c.outstanding for c in pool) + 1
        scores = {c.instance_id: self.prefix_weight * min(c.matched_tokens, length) / length
                  - self.load_weight * c.outstanding / busiest for c in pool}
        best = max(pool, key=lambda c: (round(scores[c.instance_id], 9), c.kv_free_tokens, -c.cached_blocks))
        reason = "decode_prefix" if best.matched_tokens > 0 else ("decode_load" if roomy else "decode_full")
        return RouteDecision(best.instance_id, reason, 0.0, scores)

    def forget_instance(self, instance_id: str) -> None:
        self.prefill_policy.forget_instance(instance_id)
