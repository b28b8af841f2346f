"""Quantized linear layers in a model: the module swaps behind ``--quantization`` and GGUF loading.

Two ways in, one result (every quantized projection a :class:`~xllm.models.layers.QuantLinear`, a
quantized tied embedding a :class:`~xllm.models.layers.QuantEmbedding`):

- :func:`quantize_model`: a float model's ``Linear`` / ``MergedLinear`` layers (every architecture's
  projections, fused qkv and gate_up included, and the LM head) quantized at load to ``int8`` /
  ``int4_g32`` / ``int4_g128``; a Llama-family model's tied embedding too, since it is the LM head.
  MoE experts, routers and the MLA absorbed ``kv_b_proj`` stay float (they are not ``Linear`` layers).
- :func:`install_quantized`: quantized checkpoint tensors as stored (a GGUF's ``Q8_0``/``Q4_0``/``Q4_1``,
  :mod:`xllm.models.gguf_weights`) swapped in before the float parameters are materialized, fused
  projections assembled with :func:`xllm.kernels.quant.cat_rows`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from xllm.kernels.quant import QuantizedWeight, cat_rows, quantize, supports
from xllm.models.layers import Linear, MergedLinear, QuantLinear
from xllm.models.tp_layers import quant_embedding
from xllm.models.weights import StackedName, WeightLoadError

# The format of a tied embedding (the LM head) under each --quantization format: the head is the layer
# whose rounding costs the most (every logit), so 4-bit models keep it at 8 bits, as llama.cpp keeps its
# output tensor at 6-8 bits in 4-bit files (the bundled Q4_1 SmolLM2 has a Q8_0 embedding). Measured on
# SmolLM2 (benchmarks/perplexity.py): int4 with a 4-bit head 32.8 perplexity, with an int8 head see
# docs/performance.md.
HEAD_FORMAT = {"int4_g32": "int8", "int4_g128": "int8"}


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _tied_embedding_is_head(model: nn.Module) -> bool:
    """Whether ``model``'s LM head reads its input embedding (a Llama-family model with tied embeddings:
    its head is :func:`xllm.models.layers.tied_lm_head` of the embedding)."""
    from xllm.models.llama import LlamaForCausalLM

    return isinstance(model, LlamaForCausalLM) and model.lm_head is None


def weight_format(model: nn.Module) -> str | None:
    """The format most of ``model``'s quantized projections are in (e.g. ``"q4_1"`` for the bundled Q4_1
    GGUF served as stored, whose embedding is Q8_0), None for a float model."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            counts[m.qweight.fmt] = counts.get(m.qweight.fmt, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else None


def quantize_model(model: nn.Module, fmt: str) -> list[str]:
    """Quantize ``model``'s float ``Linear`` / ``MergedLinear`` layers to ``fmt`` in place (each layer's
    float weight is dropped as soon as its quantized copy exists) and, when the LM head is tied to it, the
    input embedding. Layers whose input size the format does not take (:func:`xllm.kernels.quant.supports`)
    stay float; a tied embedding takes :data:`HEAD_FORMAT` (int8 under the int4 formats). Call before
    ``post_load`` (the fused native forward binds the layers it finds then).
    Returns the paths of the quantized modules."""
    done = []
    for path, module in list(model.named_modules()):
        if isinstance(module, (Linear, MergedLinear)) and supports(fmt, module.weight.shape[1]):
            bias = None if module.bias is None else module.bias.data
            _replace(model, path, QuantLinear(quantize(module.weight.data, fmt), bias))
            done.append(path)
    if _tied_embedding_is_head(model):
        embed, head_fmt = model.model.embed_tokens, HEAD_FORMAT.get(fmt, fmt)
        if isinstance(embed, nn.Embedding) and supports(head_fmt, embed.embedding_dim):
            model.model.embed_tokens = quant_embedding(embed, quantize(embed.weight.data, head_fmt), embed.weight.dtype)
            model._tied_head = None
            done.append("model.embed_tokens")
    return done


def install_quantized(model: nn.Module, quantized: dict[str, QuantizedWeight], stacked: Iterable[StackedName],
                      dtype: torch.dtype) -> set[str]:
    """Swap quantized checkpoint tensors (HF name -> :class:`QuantizedWeight`) into ``model`` (built on the
    meta device, before materialization): a ``Linear`` whose weight is quantized becomes a ``QuantLinear``,
    a ``MergedLinear`` whose every shard is quantized in one format a ``QuantLinear`` over the shards' rows
    concatenated in shard order, a quantized ``model.embed_tokens`` a ``QuantEmbedding`` lookup in
    ``dtype``. Returns the checkpoint names consumed; the rest (a fused layer with shards of several
    formats, for instance) the caller loads as float. Quantized layers with a bias are refused
    (:class:`WeightLoadError`): no quantized checkpoint this reads has one."""
    used: set[str] = set()
    stacked = tuple(stacked)
    for path, module in list(model.named_modules()):
        if isinstance(module, Linear):
            name = f"{path}.weight"
            parts = [name] if name in quantized else []
        elif isinstance(module, MergedLinear):
            parts = [_shard_name(path, shard, stacked) for shard in module.shard_offsets]
        else:
            continue
        if not parts or not all(p in quantized for p in parts):
            continue
        weights = [quantized[p] for p in parts]
        if len({w.fmt for w in weights}) != 1:
            continue  # mixed formats (llama.cpp's mixed quantizations): loaded as float
        if module.bias is not None:
            raise WeightLoadError(f"{path}: quantized weights with a bias are not supported")
        qw = weights[0] if len(weights) == 1 else cat_rows(weights)
        if (qw.n, qw.k) != tuple(module.weight.shape):
            raise WeightLoadError(f"{path}: quantized checkpoint shape {(qw.n, qw.k)} does not fit the layer")
        _replace(model, path, QuantLinear(qw))
        used.update(parts)
    embed_name = "model.embed_tokens.weight"
    if embed_name in quantized:
        qw = quantized[embed_name]
        embed = model.model.embed_tokens
        if (qw.n, qw.k) != (embed.num_embeddings, embed.embedding_dim):
            raise WeightLoadError(f"{embed_name}: quantized checkpoint shape {(qw.n, qw.k)} does not fit")
        model.model.embed_tokens = quant_embedding(embed, qw, dtype)
        used.add(embed_name)
    return used


def _shard_name(path: str, shard: str, stacked: tuple[StackedName, ...]) -> str:
    """The checkpoint weight name of ``shard`` of the fused layer at ``path``."""
    for rule in stacked:
        if rule.shard == shard and path.endswith(rule.fused_part.lstrip(".")):
            return f"{path[:-len(rule.fused_part)]}{rule.ckpt_part}.weight"
    return f"{path}.<{shard}>"  # no rule: never a checkpoint name, so the layer stays float
