"""LoRA adapters on the routed experts of a sparse MoE block (PEFT ``target_parameters``), beside the base model.

PEFT (0.17+) adapts transformers-5's stacked expert parameters with ``LoraConfig(target_parameters=[
"mlp.experts.gate_up_proj", "mlp.experts.down_proj"])`` (a ``ParamWrapper`` per parameter). For a parameter
``W`` ``[E, out, in]`` (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) the adapter holds
``lora_A`` ``[r * E, in]`` and ``lora_B`` ``[out, r * E]``; expert ``e``'s factors are ``A_e = A[e*r:(e+1)*r]``
and ``B_e = B[:, e::E]`` (B's columns are rank-major: column ``j * E + e`` is rank ``j`` of expert ``e``), and the
expert computes ``x @ (W_e + scale * B_e @ A_e)^T``. Two targeted parameters of one module nest: the wrapper of
the parameter the module defines first (``gate_up_proj``) is the inner one, so its saved keys carry one more
``base_layer.`` (``...mlp.experts.base_layer.lora_A.weight``) than the outer one's (``...mlp.experts.lora_A.weight``).
The rank and alpha of a parameter may come from ``rank_pattern`` / ``alpha_pattern`` (PEFT writes ``r * 2`` and
``alpha * 2`` for ``gate_up_proj`` when it converts a transformers-4 ``gate_proj`` + ``up_proj`` target list).

- :func:`expert_targets` parses ``target_parameters``; :func:`expert_factors` converts PEFT's layout to per-expert
  factors (:class:`ExpertFactors`).
- :class:`ExpertLora` holds the resident adapters of one :class:`xllm.models.moe.RoutedExperts` in the stack's
  slots and runs the experts with them: for every (token, chosen expert) pair whose row uses slot ``s``, expert
  ``e``'s gate_up output gains ``scale13[s] * (x @ A13[s, e]^T) @ B13[s, e]^T`` before the activation and its
  down output ``scale2[s] * (act @ A2[s, e]^T) @ B2[s, e]^T`` before the routing-weighted sum. Pairs are sorted by
  (expert, slot): one base GEMM per active expert, one low-rank product per (expert, slot) that has pairs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from xllm.models.lora import LoraStack
    from xllm.models.moe import RoutedExperts

#: the served expert parameters, in the order transformers' expert modules define them (PEFT's nesting order)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")

# a target_parameters entry PEFT matches against "model.layers.N.mlp.experts.<param>" (equal or a dotted suffix)
_TARGET = re.compile(r"^(?:(?:(?:(?:(?:model\.)?layers\.)?\d+\.)?mlp\.)?experts\.)?(gate_up_proj|down_proj)$")


def expert_key(layer: int, param: str) -> str:
    """PEFT's name of an expert parameter (what ``target_parameters`` and ``rank_pattern`` keys match)."""
    return f"model.layers.{layer}.mlp.experts.{param}"


def expert_targets(value: object) -> tuple[list[str], list[object]]:
    """``target_parameters`` -> (its served entries, its other entries). An entry is served when it names a MoE
    block's ``experts.gate_up_proj`` / ``experts.down_proj`` (``"mlp.experts.down_proj"``, ``"down_proj"``,
    ``"model.layers.3.mlp.experts.gate_up_proj"``, ...)."""
    entries = list(value) if isinstance(value, (list, tuple)) else [value]
    served = [t for t in entries if isinstance(t, str) and _TARGET.match(t)]
    return served, [t for t in entries if not (isinstance(t, str) and _TARGET.match(t))]


def layer_params(targets: list[str], layer: int) -> list[str]:
    """The expert parameters of ``layer`` that ``targets`` name, in :data:`EXPERT_PARAMS` order (PEFT's rule:
    a target matches a key it equals or ends with after a dot)."""
    return [p for p in EXPERT_PARAMS
            if any(expert_key(layer, p) == t or expert_key(layer, p).endswith("." + t) for t in targets)]


def pattern_value(patterns: dict, key: str, default: float) -> float:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first pattern ``k`` with ``re.match((.*\\.)?(k)$)``
    on ``key`` (raises ``re.error`` for a bad pattern)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


@dataclass(frozen=True)
class ExpertFactors:
    """One expert parameter's adapter, per expert: ``a`` ``[E, r, in]``, ``b`` ``[E, out, r]`` (float32), and
    ``scale`` (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA): ``W_e + scale * b[e] @ a[e]``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[1]


def expert_factors(a: torch.Tensor, b: torch.Tensor, rank: int, scale: float) -> ExpertFactors | str:
    """PEFT's ``lora_A`` ``[r * E, in]`` / ``lora_B`` ``[out, r * E]`` -> :class:`ExpertFactors`, or why not."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] % rank or b.shape[1] != a.shape[0] or a.shape[0] == 0:
        return (f"lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not rank r={rank} per expert "
                f"([r * experts, in] / [out, r * experts])")
    experts = a.shape[0] // rank
    return ExpertFactors(a.reshape(experts, rank, a.shape[1]).contiguous(),
                         b.reshape(b.shape[0], rank, experts).permute(2, 0, 1).contiguous(), scale)


class ExpertLora:
    """The resident adapters of one :class:`xllm.models.moe.RoutedExperts` (plain tensors, allocated on the
    first install of an adapter with expert weights: ``[slots, E, max_rank, in]`` A and ``[slots, E, out,
    max_rank]`` B per parameter, zero padded, in the experts' dtype), a scale per slot and parameter (0: the
    slot has no adapter there). ``stack``: the owning :class:`xllm.models.lora.LoraStack` (its ``groups()``
    say which rows of the running forward use which slot)."""

    def __init__(self, stack: LoraStack, experts: RoutedExperts, slots: int, rank: int) -> None:
        self.stack, self.slots, self.rank = stack, slots, rank
        self.num_experts, self.hidden, self.intermediate = experts.num_experts, experts.hidden, experts.intermediate
        self.dtype, self.device = experts.w13.dtype, experts.w13.device
        self.shapes = {"gate_up_proj": (2 * self.intermediate, self.hidden),
                       "down_proj": (self.hidden, self.intermediate)}  # (out, in)
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.scales = {p: [0.0] * slots for p in EXPERT_PARAMS}

    def check(self, param: str, factors: ExpertFactors) -> str | None:
        """Why ``factors`` do not fit this block's ``param`` (None: they fit)."""
        out, inp = self.shapes[param]
        want = (self.num_experts, inp, out)
        got = (factors.a.shape[0], factors.a.shape[2], factors.b.shape[1])
        if got != want or factors.rank > self.rank:
            return (f"{factors.a.shape[0]} experts, {got[1]} in, {got[2]} out, rank {factors.rank} do not fit the "
                    f"model's experts ({want[0]} experts, {inp} in, {out} out, rank <= {self.rank})")
        return None

    def set(self, slot: int, param: str, factors: ExpertFactors) -> None:
        """Put ``factors`` (checked by :meth:`check`) into ``slot``'s rows of ``param``."""
        if param not in self.a:
            out, inp = self.shapes[param]
            e, r, n = self.num_experts, self.rank, self.slots
            self.a[param] = torch.zeros(n, e, r, inp, dtype=self.dtype, device=self.device)
            self.b[param] = torch.zeros(n, e, out, r, dtype=self.dtype, device=self.device)
        r = factors.rank
        self.a[param][slot].zero_()
        self.b[param][slot].zero_()
        self.a[param][slot, :, :r].copy_(factors.a)
        self.b[param][slot, :, :, :r].copy_(factors.b)
        self.scales[param][slot] = factors.scale

    def clear(self, slot: int) -> None:
        for param in EXPERT_PARAMS:
            if param in self.a:
                self.a[param][slot].zero_()
                self.b[param][slot].zero_()
            self.scales[param][slot] = 0.0

    def forward(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor | None:
        """:func:`xllm.kernels.moe_experts` with each row's adapter added (``hidden`` ``[T, H]``, ``weights`` /
        ``ids`` ``[T, k]``), or None when no row of the running forward uses a slot with expert weights (then
        the caller runs the plain experts)."""
        used = [(s, rows) for s, rows, _ in self.stack.groups()
                if self.scales["gate_up_proj"][s] or self.scales["down_proj"][s]]
        tokens, k = ids.shape
        if not used or tokens == 0:
            return None
        slot_of = torch.full((tokens,), -1, dtype=torch.int64, device=ids.device)
        for s, rows in used:
            slot_of[rows] = s
        n_slots, n_experts = self.slots + 1, w13.shape[0]
        pair_slot = slot_of.repeat_interleave(k) + 1  # 0: the base model
        key = ids.reshape(-1) * n_slots + pair_slot
        order = key.argsort(stable=True)  # (token, choice) pairs grouped by expert, then by slot
        counts = torch.bincount(key, minlength=n_experts * n_slots).view(n_experts, n_slots).tolist()
        token_of = order // k
        weight_of = weights.reshape(-1)[order]
        out = torch.zeros_like(hidden)
        start = 0
        for expert, per_slot in enumerate(counts):
            n = sum(per_slot)
            if n == 0:
                continue
            rows = token_of[start:start + n]
            x = hidden[rows]
            gate_up = self._add(F.linear(x, w13[expert]), x, "gate_up_proj", expert, per_slot)
            inter = gate_up.shape[-1] // 2
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            y = self._add(F.linear(act, w2[expert]), act, "down_proj", expert, per_slot)
            out.index_add_(0, rows, (y * weight_of[start:start + n, None]).to(out.dtype))
            start += n
        return out

    def _add(self, y: torch.Tensor, x: torch.Tensor, param: str, expert: int, per_slot: list[int]) -> torch.Tensor:
        """``y`` (one expert's base output of rows ``x``, sorted by slot with ``per_slot`` rows each, the base
        model's first) plus each slot's delta of ``param``."""
        if param not in self.a:
            return y
        start = per_slot[0]
        for slot, n in enumerate(per_slot[1:]):
            scale = self.scales[param][slot]
            if n and scale:
                xs = x[start:start + n]
                y[start:start + n] += scale * F.linear(F.linear(xs, self.a[param][slot, expert]),
                                                       self.b[param][slot, expert])
            start += n
        return y
