"""Tensor-parallel weight sharding at load time (Megatron-style column/row parallelism).

Rank ``r`` of ``n`` builds the model from a *local* config (its heads and KV heads, its MLP/expert
intermediate channels: :mod:`xllm.models.tp_plan` says which) and receives each checkpoint tensor already
sliced, so it copies (and reads, for row slices of a memory-mapped file) only its part:

- column-parallel weights (q / k / v, each by its own head range; gate / up; DeepSeek's ``q_proj`` /
  ``q_b_proj`` / ``kv_b_proj``; every expert's gate / up, shared experts included) and their biases:
  the rows of the rank's heads or channels;
- row-parallel weights (``o_proj``, ``down_proj``, every expert's down): the matching columns; their
  biases are kept by rank 0 and zero elsewhere, so the all-reduce of the ranks' partial outputs adds
  them once;
- the input embedding and the LM head: the rank's vocabulary rows (:mod:`xllm.models.tp_layers`);
- everything else (norms, routers, DeepSeek's latent projections) is replicated.

Rows of the column-parallel projections are head-major in HF checkpoints, so a row range of whole
heads is contiguous. Quantized tensors (a GGUF's, as stored) are sliced the same way:
:meth:`TPShard.shard_quantized` (rows are independent; a column range must start and end on the
format's block, which the channel split of :mod:`xllm.models.tp_plan` keeps).

:class:`TPShard` also carries the group's :class:`~xllm.core.parallel.comm.Communicator`: the model
calls it where partial results meet (the model's ``tp`` attribute). The default, ``SingleRank``, makes
every collective the identity: rank slices loaded in one process then give partial outputs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from xllm.core.parallel.comm import Communicator, SingleRank
from xllm.kernels.quant import BLOCK_BYTES, QuantizedWeight
from xllm.models.config import ModelConfig, ModelConfigError
from xllm.models.expert_parallel import ExpertParallelSpec
from xllm.models.tp_plan import Span, channel_span, gqa_heads, mla_heads, vocab_span

#: an xllm-only config key of a rank's local config: DeepSeek's shared-experts intermediate size
SHARED_INTERMEDIATE_KEY = "xllm_tp_shared_intermediate_size"

_VOCAB = ((r"^model\.embed_tokens\.weight$", "vocab"), (r"^lm_head\.weight$", "vocab"))
_MLP = ((r"mlp\.(gate|up)_proj\.(weight|bias)$", "mlp_col"), (r"mlp\.down_proj\.(weight|bias)$", "mlp_row"),
        (r"mlp\.experts\.\d+\.(gate|up)_proj\.weight$", "expert_col"),
        (r"mlp\.experts\.\d+\.down_proj\.weight$", "expert_row"),
        (r"mlp\.experts\.gate_up_proj$", "experts_gate_up"), (r"mlp\.experts\.down_proj$", "experts_down"))
_LLAMA = ((r"self_attn\.q_proj\.(weight|bias)$", "q"), (r"self_attn\.[kv]_proj\.(weight|bias)$", "kv"),
          (r"self_attn\.o_proj\.(weight|bias)$", "o"), *_MLP, *_VOCAB)
_DEEPSEEK = ((r"self_attn\.(q_proj|q_b_proj)\.weight$", "mla_q"), (r"self_attn\.kv_b_proj\.weight$", "mla_kvb"),
             (r"self_attn\.o_proj\.(weight|bias)$", "o"),
             (r"mlp\.shared_experts\.(gate|up)_proj\.(weight|bias)$", "shared_col"),
             (r"mlp\.shared_experts\.down_proj\.(weight|bias)$", "shared_row"), *_MLP, *_VOCAB)

# architecture -> (name pattern, kind) rules; the first match decides
_RULES: dict[str, tuple[tuple[str, str], ...]] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "Qwen3MoeForCausalLM": _LLAMA,
    "DeepseekV2ForCausalLM": _DEEPSEEK,
    "DeepseekV3ForCausalLM": _DEEPSEEK,
}
_ROW_KINDS = frozenset({"o", "mlp_row", "expert_row", "shared_row", "experts_down"})
_EXPERT_KINDS = frozenset({"expert_col", "expert_row", "experts_gate_up", "experts_down"})


@dataclass(frozen=True)
class Cut:
    """How one kind of checkpoint tensor is sliced: ``spans`` of dimension ``dim`` (counted from the
    end when negative), concatenated in order (two spans: a stacked gate/up's gate and up rows)."""

    dim: int
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class TPShard:
    """This process's place in a tensor-parallel group (``rank`` of ``size``, its ``comm``), and what
    it holds of the model (``cuts``: checkpoint tensor kind -> slice; ``vocab``: its vocabulary rows of
    ``vocab_size``). ``TPShard()`` is the one-process model: nothing is sliced, no collective runs."""

    rank: int = 0
    size: int = 1
    comm: Communicator = field(default_factory=SingleRank, compare=False, repr=False)
    rules: tuple[tuple[re.Pattern, str], ...] = field(default=(), repr=False)
    cuts: dict[str, Cut] = field(default_factory=dict, repr=False)
    local: dict[str, int] = field(default_factory=dict)  # local sizes: heads, kv heads, intermediates
    vocab: Span | None = None
    vocab_size: int = 0
    experts: ExpertParallelSpec | None = None  # expert parallelism: routed experts whole, placed by rank

    def expert_slots(self, num_experts: int) -> int | None:
        """The whole experts each rank's MoE layer holds under expert parallelism (None: split channel-wise)."""
        return None if self.experts is None or not self.parallel else self.experts.slots(num_experts, self.size)

    @property
    def parallel(self) -> bool:
        """Whether there are other ranks (collectives to run)."""
        return self.size > 1

    @classmethod
    def for_config(cls, cfg: ModelConfig, rank: int, size: int, comm: Communicator | None = None,
                   experts: ExpertParallelSpec | None = None) -> TPShard:
        """Rank ``rank`` of ``size``'s shard of ``cfg``'s model; ``comm`` (default: no collectives)
        must be a group of ``size`` in which this process is ``rank``; ``experts``: the routed experts whole,
        placed over the ranks (:mod:`xllm.models.expert_parallel`; a model without them: ModelConfigError).

        :class:`ModelConfigError` for an architecture without a plan, or sizes that cannot be split;
        ``ValueError`` for a rank outside ``[0, size)`` or a ``comm`` of another shape."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got rank {rank} of {size}")
        rules = _RULES.get(cfg.architecture)
        if rules is None:
            raise ModelConfigError(f"tensor-parallel loading is not supported for {cfg.architecture!r}; "
                                   f"supported: {', '.join(sorted(_RULES))}")
        if comm is None:
            comm = SingleRank(rank, size)
        elif (comm.rank, comm.size) != (rank, size):
            raise ValueError(f"the communicator is rank {comm.rank} of {comm.size}, not rank {rank} of {size}")
        if experts is not None and not cfg.get("moe_intermediate_size"):
            raise ModelConfigError(f"--enable-expert-parallel: {cfg.architecture} has no routed experts")
        cuts, local = _plan(cfg, rank, size, experts is not None)
        compiled = tuple((re.compile(p), kind) for p, kind in rules)
        return cls(rank, size, comm, compiled, cuts, local, vocab_span(cfg.vocab_size, size, rank), cfg.vocab_size,
                   experts)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with the sizes this rank holds: its heads and KV heads (MLA: its heads; the latent is
        whole), its dense / expert / shared-expert intermediate sizes; ``head_dim`` and ``vocab_size``
        unchanged (the vocabulary split is the embedding's and head's own: :mod:`xllm.models.tp_layers`)."""
        if not self.local:
            return cfg
        raw = dict(cfg.raw)
        heads = self.local["num_attention_heads"]
        kv_heads = self.local.get("num_key_value_heads", cfg.num_kv_heads)
        raw.update(self.local)
        if "kv_lora_rank" not in raw:
            raw["head_dim"] = cfg.head_dim
        return dataclasses.replace(cfg, num_heads=heads, num_kv_heads=kv_heads, raw=raw)

    def kind(self, name: str) -> str | None:
        """The sharding kind of checkpoint tensor ``name`` (None: replicated)."""
        for pattern, kind in self.rules:
            if pattern.search(name):
                return kind
        return None

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name``: a view where it is one range (nothing is read
        yet), a copy of the gate and up rows of a stacked experts' ``gate_up_proj``."""
        if not self.parallel:
            return tensor
        kind = self.kind(name)
        if kind is None or (self.experts is not None and kind in _EXPERT_KINDS):  # (EP: the experts pick theirs)
            return tensor
        if kind in _ROW_KINDS and tensor.dim() == 1:  # a row-parallel bias: added once, by rank 0
            return tensor if self.rank == 0 else torch.zeros_like(tensor, device="cpu")
        cut = self._cut(name, kind)
        dim = cut.dim % tensor.dim()
        parts = [_narrow(tensor, dim, span, name) for span in cut.spans]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def shard_quantized(self, name: str, qw: QuantizedWeight) -> QuantizedWeight:
        """This rank's part of a quantized 2-D checkpoint weight ``name`` (``[out, in]``): its rows, or
        its columns where the range starts and ends on the format's block (:class:`ModelConfigError`
        otherwise: the format cannot be cut there)."""
        if not self.parallel:
            return qw
        kind = self.kind(name)
        if kind is None:
            return qw
        cut = self._cut(name, kind)
        if len(cut.spans) != 1:
            raise ModelConfigError(f"{name}: a quantized stacked tensor cannot be tensor-parallel sliced")
        span = cut.spans[0]
        if kind not in _ROW_KINDS:  # output rows: independent
            if span.end > qw.n:
                raise ModelConfigError(f"{name}: rows {span.start}:{span.end} exceed the weight's {qw.n}")
            return QuantizedWeight(qw.fmt, span.size, qw.k, *(None if t is None else t[span.start:span.end]
                                                             for t in (qw.data, qw.scales, qw.zeros)))
        return _quantized_columns(name, qw, span)

    def _cut(self, name: str, kind: str) -> Cut:
        cut = self.cuts.get(kind)
        if cut is None:
            raise ModelConfigError(f"{name}: the config gives no size to split this {kind!r} tensor by")
        return cut

    def shard_stream(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            yield name, self.shard(name, tensor)


def _plan(cfg: ModelConfig, rank: int, size: int, whole_experts: bool = False) -> tuple[dict[str, Cut], dict[str, int]]:
    """The cuts and local sizes of rank ``rank`` of ``size`` for ``cfg`` (``whole_experts``: routed experts not
    split, expert parallelism)."""
    cuts: dict[str, Cut] = {}
    local: dict[str, int] = {}
    if "kv_lora_rank" in cfg.raw:  # MLA: heads split, the latent whole
        heads = mla_heads(cfg.num_heads, size, rank)
        nope, rope, v = (int(cfg.raw[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        cuts["mla_q"] = Cut(0, (heads.scaled(nope + rope),))
        cuts["mla_kvb"] = Cut(0, (heads.scaled(nope + v),))
        cuts["o"] = Cut(-1, (heads.scaled(v),))
        local["num_attention_heads"] = heads.size
    else:
        split = gqa_heads(cfg.num_heads, cfg.num_kv_heads, size, rank)
        cuts["q"] = Cut(0, (split.q.scaled(cfg.head_dim),))
        cuts["kv"] = Cut(0, (split.kv.scaled(cfg.head_dim),))
        cuts["o"] = Cut(-1, (split.q.scaled(cfg.head_dim),))
        local["num_attention_heads"], local["num_key_value_heads"] = split.q.size, split.kv.size
    if cfg.get("intermediate_size"):
        total = int(cfg.raw["intermediate_size"])
        span = channel_span(total, size, rank, "intermediate_size")
        cuts["mlp_col"], cuts["mlp_row"] = Cut(0, (span,)), Cut(-1, (span,))
        local["intermediate_size"] = span.size
    if cfg.get("moe_intermediate_size"):
        total = int(cfg.raw["moe_intermediate_size"])
        if not whole_experts:
            span = channel_span(total, size, rank, "moe_intermediate_size")
            cuts["expert_col"], cuts["expert_row"] = Cut(0, (span,)), Cut(-1, (span,))
            cuts["experts_gate_up"] = Cut(1, (span, Span(total + span.start, total + span.end)))
            cuts["experts_down"] = Cut(-1, (span,))
            local["moe_intermediate_size"] = span.size
        shared = total * int(cfg.get("n_shared_experts") or 0)
        if shared:
            span = channel_span(shared, size, rank, "moe_intermediate_size * n_shared_experts")
            cuts["shared_col"], cuts["shared_row"] = Cut(0, (span,)), Cut(-1, (span,))
            local[SHARED_INTERMEDIATE_KEY] = span.size
    cuts["vocab"] = Cut(0, (vocab_span(cfg.vocab_size, size, rank),))
    return cuts, local


def _narrow(tensor: torch.Tensor, dim: int, span: Span, name: str) -> torch.Tensor:
    if span.end > tensor.shape[dim]:
        raise ModelConfigError(f"{name}: dim {dim} of size {tensor.shape[dim]} has no range "
                               f"{span.start}:{span.end} (does the config match the checkpoint?)")
    return tensor.narrow(dim, span.start, span.size)


def _quantized_columns(name: str, qw: QuantizedWeight, span: Span) -> QuantizedWeight:
    """Columns ``span`` of ``qw``: byte ranges of whole blocks (GGUF formats, int4 groups), or of a
    per-output-channel format's bytes (its scales are per row, so they stay)."""
    group = qw.group
    per_channel = qw.group == qw.k
    if span.end > qw.k:
        raise ModelConfigError(f"{name}: columns {span.start}:{span.end} exceed the weight's {qw.k}")
    if qw.fmt == "w8a8":
        raise ModelConfigError(f"{name}: a w8a8 weight's columns cannot be sliced (its packed panels span k)")
    if not per_channel and (span.start % group or span.end % group):
        raise ModelConfigError(f"{name}: columns {span.start}:{span.end} do not fall on the {group}-wide blocks "
                               f"of {qw.fmt}, so this format cannot be tensor-parallel sliced here")
    if per_channel:
        lo, hi = span.start, span.end
    elif qw.fmt in BLOCK_BYTES:
        lo, hi = span.start // group * BLOCK_BYTES[qw.fmt], span.end // group * BLOCK_BYTES[qw.fmt]
    else:  # int4 groups: two values per byte, one scale and zero per group
        lo, hi = span.start // 2, span.end // 2
    data = qw.data[:, lo:hi].contiguous()  # (QuantizedWeight checks it holds row_bytes(fmt, k) per row)
    scales, zeros = qw.scales, qw.zeros
    if not per_channel and scales is not None:
        g0, g1 = span.start // group, span.end // group
        scales = scales[:, g0:g1].contiguous()
        zeros = None if zeros is None else zeros[:, g0:g1].contiguous()
    return QuantizedWeight(qw.fmt, qw.n, span.size, data, scales, zeros)
