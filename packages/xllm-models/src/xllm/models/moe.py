"""Sparse mixture-of-experts blocks shared by the MoE models (Qwen3-MoE, DeepSeek-V2/V3).

Checkpoint layout (HF names, relative to the block, e.g. ``model.layers.3.mlp``):

- ``gate.weight`` ``[E, H]`` (router) and, DeepSeek-V3, ``gate.e_score_correction_bias`` ``[E]``;
- ``experts.<e>.{gate,up,down}_proj.weight`` per expert (the Hub layout), or the
  stacked ``experts.gate_up_proj`` ``[E, 2I, H]`` / ``experts.down_proj`` ``[E, H, I]``
  of transformers 5's in-memory layout;
- ``shared_experts.{gate,up,down}_proj.weight`` (DeepSeek), fused to ``gate_up`` at load.

Experts are stored stacked (``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]``) and
filled one checkpoint tensor at a time, in file order, by
:meth:`RoutedExperts.load_checkpoint_tensor` (see
:func:`xllm.models.weights.load_named_weights`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from xllm.kernels import RoutingConfig, moe_expert_pairs, moe_experts, select_experts
from xllm.models.weights import SelfLoadingModule

if TYPE_CHECKING:
    from xllm.models.expert_parallel import ExpertLoad, ExpertMap

_EXPERT_RE = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class RoutedExperts(SelfLoadingModule, nn.Module):
    """``E`` SwiGLU experts of intermediate size ``I`` stacked into two parameters. ``lora``: the resident LoRA
    adapters of the experts (:class:`xllm.models.lora_experts.ExpertLora`, set when the model serves adapters):
    a forward with rows of an adapter that has expert weights runs the experts with them, never the plain
    :func:`xllm.kernels.moe_experts`.

    ``slots`` (expert parallelism, :mod:`xllm.models.expert_parallel`): the module holds ``slots`` whole experts
    (``w13`` ``[slots, 2I, H]``), the ones :meth:`place` names, and a forward runs only the (token, expert) pairs
    routed to them: its output is this rank's part of the sum."""

    lora = None
    expert_map: ExpertMap | None = None  # set by place() (expert parallelism)

    def __init__(self, num_experts: int, hidden: int, intermediate: int, slots: int | None = None) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.slots = slots
        rows = num_experts if slots is None else slots
        self.w13 = nn.Parameter(torch.empty(rows, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(rows, hidden, intermediate))
        self._loaded: set[tuple[int, str]] = set()
        self._layer, self._load = 0, None

    def place(self, expert_map: ExpertMap, layer: int, load: ExpertLoad | None) -> None:
        """Hold the experts ``expert_map`` gives this rank (before loading: the checkpoint's other experts are
        skipped); ``layer``: the MoE layer's index in ``load`` (rank 0's routed-token counts; None: not counted)."""
        self.expert_map, self._layer, self._load = expert_map, layer, load

    def swap(self, w13: torch.Tensor, w2: torch.Tensor, expert_map: ExpertMap) -> None:
        """Serve from ``w13`` / ``w2`` laid out by ``expert_map`` from the next forward on (an EPLB switch)."""
        self.w13.data, self.w2.data, self.expert_map = w13, w2, expert_map

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        emap = self.expert_map
        if emap is not None:
            phys = emap.route(ids)
            if self._load is not None:
                self._load.add(self._layer, phys)
            local = phys - emap.base
            t, j = ((local >= 0) & (local < emap.slots)).nonzero(as_tuple=True)
            return moe_expert_pairs(hidden, self.w13, self.w2, t, local[t, j], weights[t, j])
        if self.lora is not None:
            out = self.lora.forward(hidden, self.w13, self.w2, weights, ids)
            if out is not None:
                return out
        return moe_experts(hidden, self.w13, self.w2, weights, ids)

    def load_checkpoint_tensor(self, rel_name: str, tensor: torch.Tensor) -> bool:
        """Copy one checkpoint tensor (per-expert or stacked layout) into its rows.

        Returns False for a name this module does not own; raises ValueError on a
        shape mismatch.
        """
        m = _EXPERT_RE.match(rel_name)
        if m is not None:
            expert, part = int(m.group(1)), m.group(2)
            if expert >= self.num_experts:
                return False
            i = self.intermediate
            for row in self._rows(expert):
                dest = {"gate_proj": self.w13.data[row, :i], "up_proj": self.w13.data[row, i:],
                        "down_proj": self.w2.data[row]}[part]
                _copy(dest, tensor, rel_name)
            self._loaded.add((expert, part))
            return True
        if self.expert_map is not None and rel_name in ("gate_up_proj", "down_proj"):  # stacked: this rank's rows
            dest = self.w13.data if rel_name == "gate_up_proj" else self.w2.data
            if tensor.shape[0] != self.num_experts:
                raise ValueError(f"{rel_name}: checkpoint holds {tensor.shape[0]} experts, not {self.num_experts}")
            for row, expert in enumerate(self.expert_map.local):
                _copy(dest[row], tensor[expert], rel_name)
            parts = ("gate_proj", "up_proj") if rel_name == "gate_up_proj" else ("down_proj",)
            self._loaded.update((e, p) for e in range(self.num_experts) for p in parts)
            return True
        if rel_name == "gate_up_proj":
            _copy(self.w13.data, tensor, rel_name)
            self._loaded.update((e, p) for e in range(self.num_experts) for p in ("gate_proj", "up_proj"))
            return True
        if rel_name == "down_proj":
            _copy(self.w2.data, tensor, rel_name)
            self._loaded.update((e, "down_proj") for e in range(self.num_experts))
            return True
        return False

    def _rows(self, expert: int) -> list[int]:
        """The rows of ``w13`` / ``w2`` that hold logical expert ``expert`` (none: another rank's)."""
        if self.expert_map is None:
            return [expert]
        return [row for row, e in enumerate(self.expert_map.local) if e == expert]

    def missing_checkpoint_tensors(self) -> list[str]:
        return [f"{e}.{p}.weight" for e in range(self.num_experts) for p in ("gate_proj", "up_proj", "down_proj")
                if (e, p) not in self._loaded]


class Router(SelfLoadingModule, nn.Module):
    """Router logits ``[T, E]`` from hidden ``[T, H]``, plus DeepSeek-V3's correction bias.

    ``fp32_logits`` computes the logits in float32 (DeepSeek); otherwise in the
    model dtype (Qwen3-MoE). The correction bias is kept in float32 whatever the
    model dtype (as HF does), so it is loaded here rather than as a parameter
    that the loader would cast.
    """

    def __init__(self, num_experts: int, hidden: int, fp32_logits: bool, has_correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.fp32_logits = fp32_logits
        self.has_correction_bias = has_correction_bias
        self.correction_bias: torch.Tensor | None = None
        self._weight_loaded = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fp32_logits:
            return nn.functional.linear(hidden.float(), self.weight.float())
        return nn.functional.linear(hidden, self.weight)

    def load_checkpoint_tensor(self, rel_name: str, tensor: torch.Tensor) -> bool:
        if rel_name == "weight":
            _copy(self.weight.data, tensor, rel_name)
            self._weight_loaded = True
            return True
        if rel_name == "e_score_correction_bias" and self.has_correction_bias:
            if tuple(tensor.shape) != (self.weight.shape[0],):
                raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != ({self.weight.shape[0]},)")
            self.correction_bias = tensor.to(device=self.weight.device, dtype=torch.float32, copy=True)
            return True
        return False

    def missing_checkpoint_tensors(self) -> list[str]:
        missing = [] if self._weight_loaded else ["weight"]
        if self.has_correction_bias and self.correction_bias is None:
            missing.append("e_score_correction_bias")
        return missing


class SparseMoeBlock(nn.Module):
    """Router -> top-k experts (weighted sum) [+ always-on shared experts].

    ``shared`` is any ``[T, H] -> [T, H]`` module (DeepSeek's shared experts) or
    None. Output: ``sum_j w_j expert_j(x) (+ shared(x))``. ``slots``: expert-parallel experts
    (:class:`RoutedExperts`).
    """

    def __init__(self, hidden: int, num_experts: int, intermediate: int, routing: RoutingConfig,
                 fp32_router: bool = False, correction_bias: bool = False, shared: nn.Module | None = None,
                 slots: int | None = None) -> None:
        super().__init__()
        self.routing = routing
        self.gate = Router(num_experts, hidden, fp32_router, correction_bias)
        self.experts = RoutedExperts(num_experts, hidden, intermediate, slots)
        self.shared_experts = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.routing, self.gate.correction_bias)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def _copy(dest: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dest.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(dest.shape)}")
    dest.copy_(src)
