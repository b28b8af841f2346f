"""LoRA adapters in PEFT's format, served beside the base model in one batch (multi-LoRA).

- :func:`read_peft_adapter` reads an adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``
  with PEFT's key names, ``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``, ...) and refuses
  what is not supported with a :class:`LoraAdapterError` naming the field (DoRA, biases, ``modules_to_save``,
  rank or alpha patterns on modules, parameter targets other than MoE experts, a rank above ``max_rank``).
- :class:`LoraStack` holds the resident adapters of a model in ``max_loras`` fixed slots: per target projection
  A ``[slots, parts * r_max, in]`` and B ``[slots, out, r_max]`` (zero padded; a fused projection, qkv or
  gate_up, has one part per checkpoint projection: its A rows a block of ``r_max``, its output rows' B rows that
  part's columns, so B holds no zero blocks), a scale per slot. A projection adds, per part, ``scale[s] *
  (x @ A[s, part]^T) @ B[s, part rows]^T`` to the rows whose slot is ``s`` (slot -1: the base model alone):
  the segmented product, grouped by slot (:func:`xllm.kernels.lora.segmented_lora`: one native call per
  projection, else a torch loop over the step's distinct slots). :meth:`LoraStack.rows` says which slot each
  row of the forward about to run uses (per thread: a draft forward on another thread is not affected).

Targets: q, k, v, o, gate, up, down projections of Llama-style layers (attention and dense MLPs), and a sparse
MoE block's experts (PEFT ``target_parameters`` ``experts.gate_up_proj`` / ``experts.down_proj``, with their
``rank_pattern`` / ``alpha_pattern``: :mod:`xllm.models.lora_experts`).
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from xllm.kernels.lora import LoraLayout, LoraRows, segmented_lora
from xllm.models.layers import Linear, MergedLinear
from xllm.models.lora_experts import (
    ExpertFactors,
    ExpertLora,
    expert_factors,
    expert_key,
    expert_targets,
    layer_params,
    pattern_value,
)
from xllm.models.moe import RoutedExperts

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT module name -> (the layer's submodule, our projection there, the part of a fused projection or None)
TARGETS: dict[str, tuple[str, str, str | None]] = {
    "q_proj": ("self_attn", "qkv_proj", "q"),
    "k_proj": ("self_attn", "qkv_proj", "k"),
    "v_proj": ("self_attn", "qkv_proj", "v"),
    "o_proj": ("self_attn", "o_proj", None),
    "gate_proj": ("mlp", "gate_up_proj", "gate"),
    "up_proj": ("mlp", "gate_up_proj", "up"),
    "down_proj": ("mlp", "down_proj", None),
}

_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# an expert parameter's wrapper: one "base_layer." per wrapper nested around it (lora_experts)
_EXPERT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)lora_([AB])"
                         r"\.weight$")

# adapter_config.json fields that change the product in ways this module does not implement: a truthy value
# is refused (``bias`` must be "none"; ``target_parameters`` only the MoE experts'; ``rank_pattern`` /
# ``alpha_pattern`` only where no module target matches them: :func:`_read_weights`)
_REFUSED_FIELDS = ("use_dora", "lora_bias", "modules_to_save", "fan_in_fan_out", "trainable_token_indices",
                   "layer_replication", "alora_invocation_tokens", "use_qalora", "use_bdlora")


class LoraAdapterError(ValueError):
    """An adapter directory that cannot be served; the message names the file, field or tensor."""


@dataclass(frozen=True)
class PeftAdapter:
    """One adapter as read from its directory (float32 tensors on the CPU).

    ``weights[(layer, module)]`` is ``(A [rank, in], B [out, rank])`` for a PEFT module name of :data:`TARGETS`;
    ``scale`` is ``lora_alpha / rank`` (``lora_alpha / sqrt(rank)`` with ``use_rslora``); ``identity`` a 64-bit
    hash of the adapter's two files (non-zero), equal for the same files wherever they are read. ``experts[(layer,
    param)]``: the adapter of a MoE block's expert parameter (``gate_up_proj`` / ``down_proj``), per expert and
    with its own scale (:class:`xllm.models.lora_experts.ExpertFactors`)."""

    path: pathlib.Path
    rank: int
    scale: float
    identity: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    experts: dict[tuple[int, str], ExpertFactors] = field(default_factory=dict)


@dataclass(frozen=True)
class _Config:
    """The checked fields of an ``adapter_config.json`` that shape the weights."""

    where: pathlib.Path
    rank: int
    alpha: float
    rslora: bool
    expert_targets: list[str]  # the target_parameters entries (all on MoE experts)
    patterns: dict[str, dict[str, int | float]]  # rank_pattern / alpha_pattern

    def scale(self, rank: int, alpha: float) -> float:
        return float(alpha) / (math.sqrt(rank) if self.rslora else rank)


def adapter_identity(path: str | pathlib.Path) -> int:
    """The 64-bit BLAKE2b of the adapter's config and weights files (never 0, the base model's root hash)."""
    h = hashlib.blake2b(digest_size=8, person=b"xllm-lora")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(pathlib.Path(path) / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return int.from_bytes(h.digest(), "little") or 1


def read_peft_adapter(path: str | pathlib.Path, max_rank: int) -> PeftAdapter:
    """Read and check the PEFT LoRA adapter in directory ``path``; raises :class:`LoraAdapterError`."""
    path = pathlib.Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise LoraAdapterError(f"{path}: no {name} (a PEFT LoRA adapter directory has {CONFIG_FILE} and "
                                   f"{WEIGHTS_FILE})")
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(f"{path / CONFIG_FILE}: not readable JSON ({exc})") from None
    conf = _check_config(path, cfg, max_rank)
    weights, experts = _read_weights(path, conf, max_rank)
    return PeftAdapter(path, conf.rank, conf.scale(conf.rank, conf.alpha), adapter_identity(path), weights, experts)


def _check_config(path: pathlib.Path, cfg: dict, max_rank: int) -> _Config:
    where = path / CONFIG_FILE
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for name in _REFUSED_FIELDS:
        if cfg.get(name):
            raise LoraAdapterError(f"{where}: {name}={cfg[name]!r} is not supported")
    targets, other = expert_targets(cfg.get("target_parameters") or [])
    if other:
        raise LoraAdapterError(f"{where}: target_parameters entry {other[0]!r} is not supported (served: a MoE "
                               "block's experts.gate_up_proj and experts.down_proj)")
    patterns = {}
    for name in ("rank_pattern", "alpha_pattern"):
        value = cfg.get(name) or {}
        if not isinstance(value, dict):
            raise LoraAdapterError(f"{where}: {name} must be an object, got {value!r}")
        for key in value:
            try:
                re.compile(rf"(.*\.)?({key})$")
            except re.error as exc:
                raise LoraAdapterError(f"{where}: {name} key {key!r} is not a regular expression ({exc})") from None
        patterns[name] = value
    if cfg.get("bias", "none") != "none":
        raise LoraAdapterError(f"{where}: bias={cfg['bias']!r} is not supported (only 'none')")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoraAdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraAdapterError(f"{where}: r={rank} is above --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)):
        raise LoraAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    return _Config(where, rank, float(alpha), bool(cfg.get("use_rslora")), targets, patterns)


def _read_weights(path: pathlib.Path, conf: _Config, max_rank: int) -> tuple[
        dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], dict[tuple[int, str], ExpertFactors]]:
    rank = conf.rank
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    nested: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (layer, wrapper depth) -> expert A / B
    with safe_open(path / WEIGHTS_FILE, framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            m = _EXPERT_KEY.match(key)
            if m is not None:
                nested.setdefault((int(m[1]), m[2].count("base_layer.")), {})[m[3]] = f.get_tensor(key).float()
                continue
            m = _KEY.match(key)
            if m is None:
                raise LoraAdapterError(f"{path / WEIGHTS_FILE}: tensor {key!r} is not a LoRA A/B weight of a "
                                       f"decoder layer's projection ({', '.join(TARGETS)})")
            layer, sub, module, which = int(m[1]), m[2], m[3], m[4]
            if module not in TARGETS or TARGETS[module][0] != sub:
                raise LoraAdapterError(f"{path / WEIGHTS_FILE}: tensor {key!r}: target module {sub}.{module} is "
                                       f"not supported (supported: {', '.join(TARGETS)})")
            parts.setdefault((layer, module), {})[which] = f.get_tensor(key).float()
    if not parts and not nested:
        raise LoraAdapterError(f"{path / WEIGHTS_FILE}: no LoRA weights")
    out = {}
    for (layer, module), ab in sorted(parts.items()):
        name = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoraAdapterError(f"{path / WEIGHTS_FILE}: {name} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraAdapterError(f"{path / WEIGHTS_FILE}: {name}: lora_A {tuple(a.shape)} / lora_B "
                                   f"{tuple(b.shape)} do not have rank r={rank}")
        module_key = f"model.layers.{layer}.{TARGETS[module][0]}.{module}"
        for field_name, patterns in conf.patterns.items():
            for pattern in patterns:
                if re.match(rf"(.*\.)?({pattern})$", module_key):
                    raise LoraAdapterError(f"{conf.where}: {field_name} key {pattern!r} applies to module "
                                           f"{module_key}: per-target ranks and alphas are served on MoE expert "
                                           "parameters only")
        out[(layer, module)] = (a, b)
    return out, _expert_weights(path, conf, nested, max_rank)


def _expert_weights(path: pathlib.Path, conf: _Config, nested: dict[tuple[int, int], dict[str, torch.Tensor]],
                    max_rank: int) -> dict[tuple[int, str], ExpertFactors]:
    """The expert parameters' factors from their A / B per (layer, wrapper depth): of the ``n`` parameters
    ``target_parameters`` names in a layer (in :data:`xllm.models.lora_experts.EXPERT_PARAMS` order), the
    ``i``-th is wrapped ``n - 1 - i`` levels deep (PEFT nests a module's wrappers in its parameter order)."""
    out = {}
    for (layer, depth), ab in sorted(nested.items()):
        params = layer_params(conf.expert_targets, layer)
        name = f"layers.{layer}.mlp.experts.{'base_layer.' * depth}lora_*"
        if depth >= len(params):
            raise LoraAdapterError(f"{path / WEIGHTS_FILE}: {name}: an expert parameter's LoRA weights, but "
                                   f"target_parameters={conf.expert_targets!r} names {len(params)} expert "
                                   f"parameter(s) of layer {layer}")
        param = params[len(params) - 1 - depth]
        if set(ab) != {"A", "B"}:
            raise LoraAdapterError(f"{path / WEIGHTS_FILE}: {name} has lora_{''.join(ab)} without its pair")
        key = expert_key(layer, param)
        rank = pattern_value(conf.patterns["rank_pattern"], key, conf.rank)
        alpha = pattern_value(conf.patterns["alpha_pattern"], key, conf.alpha)
        if not isinstance(rank, int) or not 1 <= rank <= max_rank:
            raise LoraAdapterError(f"{conf.where}: rank_pattern gives {key} rank {rank!r}, not a positive integer "
                                   f"up to --max-lora-rank {max_rank}")
        if not isinstance(alpha, (int, float)):
            raise LoraAdapterError(f"{conf.where}: alpha_pattern gives {key} lora_alpha {alpha!r}, not a number")
        factors = expert_factors(ab["A"], ab["B"], rank, conf.scale(rank, alpha))
        if isinstance(factors, str):
            raise LoraAdapterError(f"{path / WEIGHTS_FILE}: layers.{layer}.mlp.experts.{param}: {factors}")
        out[(layer, param)] = factors
    return out


class LoraProjection:
    """The resident adapters of one projection (plain tensors, not parameters: the model's weights, packed
    copies and fused kernels never see them). ``parts``: part name (None for an unfused projection) ->
    ``(index, first output row, rows)``."""

    def __init__(self, stack: LoraStack, module: Linear | MergedLinear, slots: int, rank: int) -> None:
        self.stack = stack
        offsets = getattr(module, "shard_offsets", None) or {None: (0, module.weight.shape[0])}
        self.parts = {name: (i, start, size) for i, (name, (start, size)) in enumerate(offsets.items())}
        self.rank = rank
        w = module.weight
        n = len(self.parts) * rank
        self.a = torch.zeros(slots, n, w.shape[1], dtype=w.dtype, device=w.device)
        self.b = torch.zeros(slots, w.shape[0], rank, dtype=w.dtype, device=w.device)
        self.layout = LoraLayout.of(rank, self.parts.values())

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def check(self, part: str | None, a: torch.Tensor, b: torch.Tensor, name: str) -> None:
        """:class:`LoraAdapterError` unless ``a`` ``[r, in]`` / ``b`` ``[rows, r]`` fit part ``part``."""
        _, _, size = self.parts[part]
        if a.shape[1] != self.a.shape[2] or b.shape[0] != size:
            raise LoraAdapterError(f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                                   f"model's projection ({self.a.shape[2]} in, {size} out)")

    def set_part(self, slot: int, part: str | None, a: torch.Tensor, b: torch.Tensor, name: str) -> None:
        """Put one checkpoint projection's ``a`` ``[r, in]`` / ``b`` ``[rows, r]`` into ``slot``."""
        self.check(part, a, b, name)
        i, start, size = self.parts[part]
        r = a.shape[0]
        self.a[slot, i * self.rank:i * self.rank + r].copy_(a)
        self.b[slot, start:start + size, :r].copy_(b)

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the base projection of ``x``) plus each row's adapter delta (in place where it has any): the
        segmented product of :func:`xllm.kernels.lora.segmented_lora` (native kernel, else the torch loop)."""
        rows = self.stack.current_rows()
        if rows is None:
            return out
        segmented_lora(x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1]), self.a, self.b, rows, self.layout)
        return out


class LoraStack:
    """The ``max_loras`` adapter slots of one model's decoder ``layers`` (every Llama-style projection of
    :data:`TARGETS` the layers have as a float :class:`Linear` / :class:`MergedLinear`, and the float experts of
    every sparse MoE block: :class:`xllm.models.lora_experts.ExpertLora`), each at most ``max_rank``. Installing
    an adapter (:meth:`install`) writes its weights into a slot's rows; the caller (the engine's slot manager)
    decides which slot, and never rewrites a slot a running request uses."""

    def __init__(self, layers: list[torch.nn.Module], max_loras: int, max_rank: int) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be >= 1, got {max_loras}, {max_rank}")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.scales = [0.0] * max_loras
        self._local = threading.local()
        self.projections: dict[tuple[int, str], LoraProjection] = {}  # (layer, our projection name)
        for i, layer in enumerate(layers):
            for sub, attr, _ in TARGETS.values():
                module = getattr(getattr(layer, sub, None), attr, None)
                if module is None or (i, attr) in self.projections:
                    continue
                if not isinstance(module, (Linear, MergedLinear)):
                    raise LoraAdapterError(f"layer {i} {sub}.{attr} is a {type(module).__name__}: LoRA adapters need "
                                           "float weights (--quantization none)")
                proj = LoraProjection(self, module, max_loras, max_rank)
                module.lora = proj
                self.projections[(i, attr)] = proj
        self.experts: dict[int, ExpertLora] = {}  # layer -> its MoE block's experts
        for i, layer in enumerate(layers):
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if isinstance(experts, RoutedExperts) and experts.w13.dtype.is_floating_point:
                experts.lora = self.experts[i] = ExpertLora(self, experts, max_loras, max_rank)

    def read(self, path: str | pathlib.Path) -> PeftAdapter:
        """Read an adapter directory and check that it fits these layers (raises :class:`LoraAdapterError`)."""
        adapter = read_peft_adapter(path, self.max_rank)
        for (layer, module), (a, b) in adapter.weights.items():
            proj, part = self._target(layer, module, adapter.path)
            proj.check(part, a, b, f"{adapter.path}: layers.{layer}.{module}")
        for (layer, param), factors in adapter.experts.items():
            why = self._experts(layer, param, adapter.path).check(param, factors)
            if why is not None:
                raise LoraAdapterError(f"{adapter.path}: layers.{layer}.mlp.experts.{param}: {why}")
        return adapter

    def _experts(self, layer: int, param: str, where: pathlib.Path) -> ExpertLora:
        experts = self.experts.get(layer)
        if experts is None:
            raise LoraAdapterError(f"{where}: layers.{layer}.mlp.experts.{param}: layer {layer} has no sparse MoE "
                                   "block with float experts this model serves adapters on")
        return experts

    def _target(self, layer: int, module: str, where: pathlib.Path) -> tuple[LoraProjection, str | None]:
        _, attr, part = TARGETS[module]
        proj = self.projections.get((layer, attr))
        if proj is None or part not in proj.parts:
            raise LoraAdapterError(f"{where}: layers.{layer}.{module} is not a projection this model serves "
                                   "adapters on (a layer it lacks, or a sparse MoE block: its experts take "
                                   "target_parameters)")
        return proj, part

    def install(self, slot: int, adapter: PeftAdapter) -> None:
        """Make ``slot`` hold ``adapter`` (every other projection's rows of the slot zero)."""
        self.clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            proj, part = self._target(layer, module, adapter.path)
            proj.set_part(slot, part, a, b, f"{adapter.path}: layers.{layer}.{module}")
        for (layer, param), factors in adapter.experts.items():
            self._experts(layer, param, adapter.path).set(slot, param, factors)
        self.scales[slot] = adapter.scale

    def clear(self, slot: int) -> None:
        for proj in self.projections.values():
            proj.clear(slot)
        for experts in self.experts.values():
            experts.clear(slot)
        self.scales[slot] = 0.0

    def groups(self) -> list[tuple[int, torch.Tensor, float]]:
        """The forward running on this thread: ``(slot, rows, scale)`` per adapter slot it uses (empty: none)."""
        rows = self.current_rows()
        return [] if rows is None else list(rows.groups)

    def current_rows(self) -> LoraRows | None:
        """The forward running on this thread: its rows' slots (None: no row uses an adapter)."""
        return getattr(self._local, "rows", None)

    @contextmanager
    def rows(self, slots: torch.Tensor | None) -> Iterator[None]:
        """Within the block, forwards on this thread give row ``t`` the adapter in slot ``slots[t]`` (int64
        ``[T]``, -1: the base model; None: every row the base model)."""
        rows = None if slots is None else LoraRows.of(slots, self.scales)
        before = getattr(self._local, "rows", None)
        self._local.rows = rows if rows is not None and rows.groups else None
        try:
            yield
        finally:
            self._local.rows = before
