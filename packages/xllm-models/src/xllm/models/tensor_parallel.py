"""Tensor-parallel weight sharding at load time (Megatron-style column/row parallelism).

Rank ``r`` of ``n`` builds the model from a *local* config (heads, KV heads and
MLP/expert intermediate sizes divided by ``n``) and receives each checkpoint
tensor already sliced, so it copies (and reads, for row slices of a
memory-mapped file) only its part:

- column-parallel weights (q/k/v, gate/up, DeepSeek's ``q_b_proj``/``kv_b_proj``,
  every expert's gate/up) and their biases: rows ``[r*N/n, (r+1)*N/n)``;
- row-parallel weights (``o_proj``, ``down_proj``, every expert's down): columns
  ``[r*K/n, (r+1)*K/n)``; their biases are kept by rank 0 and zero elsewhere, so
  summing the ranks' partial outputs (the all-reduce) adds them once;
- everything else (embeddings, norms, routers, DeepSeek's latent projections) is replicated.

Rows of the column-parallel projections are head-major in HF checkpoints, so a
contiguous row range is a contiguous range of whole heads.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from xllm.models.config import ModelConfig, ModelConfigError

_LLAMA_COLUMN = (r"self_attn\.[qkv]_proj\.(weight|bias)$", r"mlp\.(gate|up)_proj\.(weight|bias)$",
                 r"mlp\.experts\.\d+\.(gate|up)_proj\.weight$")
_LLAMA_ROW = (r"self_attn\.o_proj\.(weight|bias)$", r"mlp\.down_proj\.(weight|bias)$",
              r"mlp\.experts\.\d+\.down_proj\.weight$")
_DEEPSEEK_COLUMN = (r"self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight$", r"mlp\.(gate|up)_proj\.(weight|bias)$",
                    r"mlp\.shared_experts\.(gate|up)_proj\.(weight|bias)$",
                    r"mlp\.experts\.\d+\.(gate|up)_proj\.weight$")
_DEEPSEEK_ROW = (r"self_attn\.o_proj\.(weight|bias)$", r"mlp\.down_proj\.(weight|bias)$",
                 r"mlp\.shared_experts\.down_proj\.(weight|bias)$", r"mlp\.experts\.\d+\.down_proj\.weight$")

# architecture -> (column patterns, row patterns, whether KV heads are split)
_PLANS: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool]] = {
    "LlamaForCausalLM": (_LLAMA_COLUMN, _LLAMA_ROW, True),
    "MistralForCausalLM": (_LLAMA_COLUMN, _LLAMA_ROW, True),
    "Qwen2ForCausalLM": (_LLAMA_COLUMN, _LLAMA_ROW, True),
    "Qwen3ForCausalLM": (_LLAMA_COLUMN, _LLAMA_ROW, True),
    "Qwen3MoeForCausalLM": (_LLAMA_COLUMN, _LLAMA_ROW, True),
    "DeepseekV2ForCausalLM": (_DEEPSEEK_COLUMN, _DEEPSEEK_ROW, False),
    "DeepseekV3ForCausalLM": (_DEEPSEEK_COLUMN, _DEEPSEEK_ROW, False),
}


@dataclass(frozen=True)
class TPShard:
    """This process's place in a tensor-parallel group and the architecture's sharding plan."""

    rank: int
    size: int
    column: tuple[re.Pattern, ...] = ()
    row: tuple[re.Pattern, ...] = ()
    split_kv_heads: bool = True

    @classmethod
    def for_architecture(cls, architecture: str, rank: int, size: int) -> TPShard:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got rank {rank} of {size}")
        plan = _PLANS.get(architecture)
        if plan is None:
            raise ModelConfigError(f"tensor-parallel loading is not supported for {architecture!r}; "
                                   f"supported: {', '.join(sorted(_PLANS))}")
        column, row, split_kv = plan
        return cls(rank, size, tuple(map(re.compile, column)), tuple(map(re.compile, row)), split_kv)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with the sizes one rank holds: heads (and KV heads unless MLA) and the
        dense/expert intermediate sizes divided by ``size``; ``head_dim`` unchanged."""
        n = self.size
        raw = dict(cfg.raw)

        def split(value: int, what: str) -> int:
            if value % n:
                raise ModelConfigError(f"{what}={value} is not divisible by tensor-parallel size {n}")
            return value // n

        heads = split(cfg.num_heads, "num_attention_heads")
        kv_heads = split(cfg.num_kv_heads, "num_key_value_heads") if self.split_kv_heads else cfg.num_kv_heads
        raw["num_attention_heads"], raw["num_key_value_heads"] = heads, kv_heads
        for key in ("intermediate_size", "moe_intermediate_size"):
            if raw.get(key):
                raw[key] = split(int(raw[key]), key)
        return dataclasses.replace(cfg, num_heads=heads, num_kv_heads=kv_heads, raw=raw)

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (a view: nothing is read yet)."""
        if self.size == 1:
            return tensor
        if any(p.search(name) for p in self.column):
            return _chunk(tensor, 0, self.rank, self.size, name)
        if any(p.search(name) for p in self.row):
            if tensor.dim() == 1:  # a row-parallel bias: added once, by rank 0
                return tensor if self.rank == 0 else torch.zeros_like(tensor, device="cpu")
            return _chunk(tensor, tensor.dim() - 1, self.rank, self.size, name)
        return tensor

    def shard_stream(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            yield name, self.shard(name, tensor)


def _chunk(tensor: torch.Tensor, dim: int, rank: int, size: int, name: str) -> torch.Tensor:
    full = tensor.shape[dim]
    if full % size:
        raise ModelConfigError(f"{name}: dim {dim} of size {full} is not divisible by tensor-parallel size {size}")
    part = full // size
    return tensor.narrow(dim, rank * part, part)
