"""Building blocks shared by the decoder models: norms, fused projections (float or quantized), RoPE."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from xllm.kernels import RotaryTable, linear, quant_native, rms_norm
from xllm.kernels.gemm import PackedWeight, pack
from xllm.kernels.gemm_choice import GemmChoice, choose
from xllm.kernels.linear import MAX_NATIVE_ROWS, linear_argmax, pack_weight
from xllm.kernels.quant import QuantizedWeight, dequantize, quant_argmax, quant_linear
from xllm.models.config import ModelConfig, ModelConfigError, rope_parameters
from xllm.models.weights import CheckpointShards


class LMHead(Protocol):
    """An LM head as the model classes use it: the float32 logits of hidden rows, and their row argmax
    (first index on ties) exactly, which the native kernels compute without writing the logits."""

    def logits(self, x: torch.Tensor) -> torch.Tensor: ...

    def greedy(self, x: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, res = rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, res)


class PackOnDemand:
    """Mixin: packed weight copies for large batches, made the first time more rows than the native
    GEMV takes go through the layer, so loading stays a pure copy and decode-only use never pays for
    (or stores) them. At that point :func:`xllm.kernels.gemm_choice.choose` says, per row-count
    bucket, whether the native packed GEMM or oneDNN measured faster for this weight's shape (timed
    once per machine and shape, then cached on disk), and only the copies some bucket uses are kept.
    Steps of 2-8 rows (batched decode, speculative verify chunks) take the native packed copy, made
    the first time such a step comes.
    """

    packed: torch.Tensor | None = None  # oneDNN's blocked copy
    _native: PackedWeight | None = None
    _native_tried = False
    _choice: GemmChoice | None = None
    _pack_tried = False

    def drop_packed(self) -> None:
        """Forget the packed copies (call after writing ``weight`` in place: they are rebuilt from it on
        demand). A fused native forward bound before holds its own copies: build it again (``post_load``)."""
        self.packed, self._native, self._choice = None, None, None
        self._native_tried = self._pack_tried = False

    def native_packed(self) -> PackedWeight | None:
        """The native packed copy of ``weight`` (built once, whatever the measured choice; None where
        the native library or the shape contract is unavailable): what fused native forwards use."""
        if not self._native_tried:
            self._native_tried = True
            self._native = pack(self.weight)
        return self._native

    def _packed_for(self, x: torch.Tensor) -> dict:
        """Keyword arguments of :func:`linear` for ``x``: the packed copies and the choice."""
        if torch.compiler.is_compiling():
            return {}  # Inductor freezes and packs the weights of a compiled graph itself
        if x.dim() == 2 and 2 <= x.shape[0] <= MAX_NATIVE_ROWS:  # the native packed GEMM (linear's docstring)
            return {"native_packed": self.native_packed()}
        if not self._pack_tried and x.dim() == 2 and x.shape[0] > MAX_NATIVE_ROWS:
            self._pack_tried = True
            self._choice = choose(self.weight)
            if self._choice is None or self._choice.any_onednn:
                self.packed = pack_weight(self.weight)
            if self._choice is not None and (self._choice.any_native or self.packed is None):
                self.native_packed()
        return {"packed": self.packed, "native_packed": self._native, "choice": self._choice}


class Linear(PackOnDemand, nn.Linear):
    """``nn.Linear`` with the native skinny-GEMM path for decode-sized inputs and prepacked weights
    (native or oneDNN, as measured) for larger ones. ``lora``: the resident LoRA adapters of this projection
    (:class:`xllm.models.lora.LoraProjection`, set when the model serves adapters), added per row."""

    lora = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias, **self._packed_for(x))
        return out if self.lora is None else self.lora.apply(x, out)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x).float()`` exactly (an LM head's logits), which the native packed GEMM writes in one
        pass instead of a bf16 output and its conversion."""
        return linear(x, self.weight, self.bias, widen=True, **self._packed_for(x))

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """``logits(x).argmax(-1)`` exactly (first index on ties), without the logits where the native
        packed GEMM runs (a greedy LM head)."""
        return linear_argmax(x, self.weight, self.bias, **self._packed_for(x))


class TiedLMHead(PackOnDemand):
    """The LM head of a model whose head shares the input embedding's weight, packed like
    :class:`Linear` (not a module: the parameter belongs to the embedding)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return linear(x, self.weight)
        return linear(x, self.weight, **self._packed_for(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()`` exactly, written in one pass where the native packed GEMM runs."""
        if torch.compiler.is_compiling():
            return linear(x, self.weight).float()
        return linear(x, self.weight, widen=True, **self._packed_for(x))

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """``logits(x).argmax(-1)`` exactly (first index on ties), without the logits where the native
        packed GEMM runs."""
        if torch.compiler.is_compiling():
            return self.logits(x).argmax(dim=-1)
        return linear_argmax(x, self.weight, **self._packed_for(x))


class QuantLinear(nn.Module):
    """A linear layer over a quantized weight (:class:`xllm.kernels.quant.QuantizedWeight`, any format of
    ``xllm.kernels.quant.FORMATS``): ``qweight`` ``[out_features, in_features]`` as packed, never
    dequantized as a whole; ``bias`` float (or None). The forward is :func:`xllm.kernels.quant.quant_linear`
    (the native skinny GEMV for decode-sized inputs); the output has the input's dtype. Fused projections
    (qkv, gate_up) hold their parts' rows concatenated (:func:`xllm.kernels.quant.cat_rows`)."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = qweight
        self.in_features, self.out_features = qweight.k, qweight.n
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.qweight, self.bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x).float()`` (an LM head's logits)."""
        return self(x).float()

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """``logits(x).argmax(-1)`` exactly (first index on ties), without the logits where the native
        kernels run."""
        return quant_argmax(x, self.qweight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.qweight.fmt}"


class QuantEmbedding(nn.Module):
    """A token embedding stored quantized (a GGUF's ``token_embd``, or a tied embedding quantized at load):
    a lookup dequantizes only the looked-up rows, to ``dtype``. When the LM head is tied to it, the head
    reads the same packed rows (:func:`tied_lm_head`)."""

    def __init__(self, qweight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.qweight = qweight
        self.num_embeddings, self.embedding_dim = qweight.n, qweight.k
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).long()
        if ids.numel():  # (the native lookup reads the rows it is given: check them as index_select would)
            lo, hi = torch.aminmax(ids)
            if int(lo) < 0 or int(hi) >= self.num_embeddings:
                raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        rows = quant_native.gather_rows(self.qweight, ids, self.dtype)  # the same bits, natively
        if rows is None:
            rows = dequantize(self.qweight.rows(ids), self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.qweight.fmt}"


class QuantTiedHead:
    """The LM head of a model whose head is tied to a :class:`QuantEmbedding` (not a module: the weight
    belongs to the embedding)."""

    def __init__(self, qweight: QuantizedWeight) -> None:
        self.qweight = qweight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.qweight)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()`` (an LM head's logits)."""
        return self(x).float()

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """``logits(x).argmax(-1)`` exactly (first index on ties), without the logits where the native
        kernels run."""
        return quant_argmax(x, self.qweight)


def streamed_tensors(part: object) -> list[torch.Tensor]:
    """The tensors the kernels read of one linear, embedding or LM head each step they run it, packed
    copies first (a float layer's native packed copy is made here: the blocked GEMM's weight), then the
    plain weight (the one-row GEMV's, an embedding's lookups); a quantized weight's data, panels and
    scales. Empty for anything else."""
    if isinstance(part, (QuantLinear, QuantEmbedding, QuantTiedHead)):
        qw = part.qweight
        return [t for t in (qw.packed, qw.data, qw.scales, qw.zeros) if t is not None]
    if isinstance(part, PackOnDemand):
        pw = part.native_packed()
        return ([] if pw is None else [pw.data]) + [part.weight]
    if isinstance(part, nn.Embedding):
        return [part.weight]
    return []


def tied_lm_head(embedding: nn.Module) -> TiedLMHead | QuantTiedHead:
    """The LM head reading ``embedding``'s weight (tied word embeddings), float or quantized."""
    if isinstance(embedding, QuantEmbedding):
        return QuantTiedHead(embedding.qweight)
    return TiedLMHead(embedding.weight)


class MergedLinear(PackOnDemand, CheckpointShards, nn.Module):
    """A linear layer whose output rows are several checkpoint weights stacked.

    ``shards`` maps a checkpoint shard name (e.g. ``"q"``) to its output size;
    :meth:`load_shard` copies one checkpoint tensor into its row range, so fused
    weights (qkv, gate_up) are assembled at load time. ``lora``: as :class:`Linear`'s (one adapter part per shard).
    """

    lora = None

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__()
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (start, size)
            start += size
        self.weight = nn.Parameter(torch.empty(start, in_features))
        self.bias = nn.Parameter(torch.empty(start)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias, **self._packed_for(x))
        return out if self.lora is None else self.lora.apply(x, out)

    def shard_kinds(self) -> list[str]:
        return ["weight"] if self.bias is None else ["weight", "bias"]

    def load_shard(self, shard: str, kind: str, tensor: torch.Tensor) -> None:
        start, size = self.shard_offsets[shard]
        target = self.weight if kind == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {kind} for shard {shard!r} but the layer has none")
        dest = target.data[start:start + size]
        if dest.shape != tensor.shape:
            raise ValueError(f"shard {shard!r} {kind}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
        dest.copy_(tensor)


def build_rotary(cfg: ModelConfig, rotary_dim: int) -> RotaryTable:
    """The RoPE table for ``cfg`` (default and llama3-style scaled frequencies)."""
    params = rope_parameters(cfg.raw)
    kind = params.get("rope_type", "default")
    base = float(params.get("rope_theta", cfg.rope_theta))
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponent)
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    elif kind == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif kind != "default":
        raise ModelConfigError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3)")
    return RotaryTable.build(rotary_dim, cfg.max_position_embeddings, base, inv_freq=inv_freq)


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
