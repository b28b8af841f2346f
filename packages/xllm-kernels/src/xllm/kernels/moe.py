"""Mixture-of-experts ops: expert selection (routing) and the routed SwiGLU experts.

Routing covers the schemes of the served MoE models:

- Qwen3-MoE / Mixtral: softmax over all experts, top-k, optional renormalization;
- DeepSeek-V2: softmax, optionally *group-limited* (keep the ``topk_groups``
  groups with the best max score, then top-k inside them), scaled by
  ``routed_scaling_factor``;
- DeepSeek-V3 (``noaux_tc``): sigmoid scores; experts are *chosen* on the
  scores plus a per-expert correction bias (groups ranked by the sum of their
  two best biased scores) but *weighted* by the unbiased scores, renormalized
  and scaled.

The expert computation gathers, for each expert that received tokens, the
tokens routed to it, runs its SwiGLU MLP on them and scatters the weighted
result back (tokens sorted by expert: one gather per active expert, no work
for idle experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from xllm.kernels.linear import dense

_SCORINGS = ("softmax", "sigmoid")
_GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True)
class RoutingConfig:
    """How a router turns logits ``[T, E]`` into ``top_k`` (weight, expert) pairs per token.

    ``scoring``: ``"softmax"`` or ``"sigmoid"``. ``renormalize``: divide the
    chosen weights by their sum. ``num_groups``/``topk_groups``: group-limited
    routing (``num_groups == 1`` disables it); ``group_score`` ranks groups by
    their best score (``"max"``, DeepSeek-V2) or the sum of their two best
    (``"top2_sum"``, DeepSeek-V3). ``scaling`` multiplies the final weights
    (``routed_scaling_factor``). ``scale_after_renormalize``: when False, a
    renormalized routing is not scaled (the original DeepSeek-V2 rule: either
    renormalize or scale).
    """

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    scaling: float = 1.0
    scale_after_renormalize: bool = True

    def __post_init__(self) -> None:
        if self.scoring not in _SCORINGS:
            raise ValueError(f"scoring must be one of {_SCORINGS}, got {self.scoring!r}")
        if self.group_score not in _GROUP_SCORES:
            raise ValueError(f"group_score must be one of {_GROUP_SCORES}, got {self.group_score!r}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.num_groups < 1 or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"need 1 <= topk_groups ({self.topk_groups}) <= num_groups ({self.num_groups})")


def select_experts(router_logits: torch.Tensor, cfg: RoutingConfig,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token: ``router_logits`` ``[T, E]`` -> (weights float32 ``[T, k]``, expert ids int64 ``[T, k]``).

    Scores are computed in float32. ``correction_bias`` (``[E]``) only affects
    which experts are chosen, never their weights. With groups, ``E`` must be a
    multiple of ``num_groups``; experts outside the kept groups are never chosen.
    """
    logits = router_logits.float()
    tokens, experts = logits.shape
    if cfg.top_k > experts:
        raise ValueError(f"top_k {cfg.top_k} exceeds the {experts} experts")
    scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float().unsqueeze(0)
    if cfg.num_groups > 1:
        if experts % cfg.num_groups:
            raise ValueError(f"{experts} experts do not split into {cfg.num_groups} groups")
        grouped = choice.view(tokens, cfg.num_groups, experts // cfg.num_groups)
        if cfg.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(cfg.topk_groups, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
        # Softmax scores are >= 0, so 0 excludes as well as -inf and matches the reference
        # (DeepSeek-V2 masks with 0); biased sigmoid scores can be negative: use -inf.
        fill = 0.0 if correction_bias is None and cfg.scoring == "softmax" else float("-inf")
        choice = choice.masked_fill(~expert_mask, fill)
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)  # chosen experts are never masked: the unbiased scores
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.scale_after_renormalize:
            weights = weights * cfg.scaling
    else:
        weights = weights * cfg.scaling
    return weights, ids


def moe_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the routed experts' SwiGLU MLPs: ``[T, H]`` -> ``[T, H]``.

    ``w13`` is ``[E, 2I, H]`` (gate rows then up rows), ``w2`` ``[E, H, I]``;
    ``weights``/``ids`` are ``[T, k]`` from :func:`select_experts`. Token ``t``'s
    output is ``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``
    with ``e = ids[t, j]``; contributions are accumulated expert by expert in
    increasing expert order. Output dtype is ``hidden.dtype``.
    """
    tokens, k = ids.shape
    token_of = torch.arange(tokens, device=ids.device).repeat_interleave(k)
    return moe_expert_pairs(hidden, w13, w2, token_of, ids.reshape(-1), weights.reshape(-1))


def moe_expert_pairs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, tokens: torch.Tensor,
                     experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """:func:`moe_experts` over a list of (token, expert, weight) pairs (``[P]`` each): token ``t``'s output is
    the weighted sum of the SwiGLU MLPs of the experts its pairs name, zero for a token without pairs (an
    expert-parallel rank passes the pairs of the experts it holds, :mod:`xllm.models.expert_parallel`).
    Contributions are accumulated expert by expert in increasing expert order, pairs of one expert in their
    given order."""
    out = torch.zeros_like(hidden)
    if len(experts) == 0:
        return out
    order = experts.argsort(stable=True)  # pairs grouped by expert
    counts = torch.bincount(experts, minlength=w13.shape[0]).tolist()
    token_of = tokens[order]
    weight_of = weights[order]
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start:start + n]
        gate_up = dense(hidden[rows], w13[expert])
        inter = gate_up.shape[-1] // 2
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = dense(act, w2[expert]) * weight_of[start:start + n, None]
        out.index_add_(0, rows, y.to(out.dtype))
        start += n
    return out


def moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """Dense reference of :func:`moe_experts`: every expert on every token, combined
    with a dense ``[T, E]`` weight matrix (zeros for experts a token did not pick)."""
    tokens, experts = hidden.shape[0], w13.shape[0]
    dense = torch.zeros(tokens, experts, dtype=torch.float32, device=hidden.device)
    dense.scatter_add_(1, ids, weights.float())
    gate_up = torch.einsum("th,eoh->teo", hidden.float(), w13.float())
    inter = gate_up.shape[-1] // 2
    act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    y = torch.einsum("tei,ehi->teh", act, w2.float())
    return (y * dense.unsqueeze(-1)).sum(1).to(hidden.dtype)
