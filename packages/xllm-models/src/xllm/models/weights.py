"""Mapping checkpoint tensors onto model parameters (fused shards, casting, completeness)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


class WeightLoadError(RuntimeError):
    """The checkpoint does not match the model: missing, unexpected or misshapen tensors."""


class CheckpointShards(ABC):
    """A module whose ``weight`` (and ``bias``, if any) stack several checkpoint tensors (fused
    qkv, gate_up): ``shard_offsets`` maps each shard name to its ``(start, size)`` rows."""

    shard_offsets: dict[str, tuple[int, int]]

    @abstractmethod
    def load_shard(self, shard: str, kind: str, tensor: torch.Tensor) -> None:
        """Copy checkpoint ``tensor`` into the rows of ``shard`` of the ``kind`` (weight/bias)
        parameter; ``ValueError`` if it does not fit."""

    @abstractmethod
    def shard_kinds(self) -> list[str]:
        """The parameters every shard fills (``"weight"``, and ``"bias"`` when there is one)."""


class SelfLoadingModule(ABC):
    """A module that takes its checkpoint tensors itself (e.g. MoE experts stacked into one
    parameter): every tensor named ``<module path>.<rel_name>`` goes to it."""

    @abstractmethod
    def load_checkpoint_tensor(self, rel_name: str, tensor: torch.Tensor) -> bool:
        """Take one checkpoint tensor; False if the name is not one of ours (unexpected);
        ``ValueError`` if it does not fit."""

    @abstractmethod
    def missing_checkpoint_tensors(self) -> list[str]:
        """Relative names still missing (replaces the completeness check of its parameters)."""


@dataclass(frozen=True)
class StackedName:
    """Checkpoint tensor ``...<ckpt_part>.weight`` goes to shard ``shard`` of
    fused parameter ``...<fused_part>.weight``."""

    fused_part: str
    ckpt_part: str
    shard: str


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Iterable[StackedName] = (),
    skip_suffixes: tuple[str, ...] = (),
) -> None:
    """Copy (and cast) each checkpoint tensor straight into its parameter.

    Raises :class:`WeightLoadError` naming unexpected checkpoint tensors and
    parameters the checkpoint never set. A fused parameter counts as set when
    all of its shards arrived.

    Fused parameters are :class:`CheckpointShards` (filled shard by shard through the
    ``stacked`` name rules); a :class:`SelfLoadingModule` takes the tensors under its
    path itself.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    custom = {name: m for name, m in modules.items() if name and isinstance(m, SelfLoadingModule)}
    stacked = tuple(stacked)
    expected_shards: dict[str, set[str]] = {}
    for name, module in modules.items():
        if isinstance(module, CheckpointShards):
            for kind in module.shard_kinds():
                expected_shards[f"{name}.{kind}"] = set(module.shard_offsets)
    seen_shards: dict[str, set[str]] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(skip_suffixes):
            continue
        owner = _custom_owner(name, custom) if custom else None
        if owner is not None:
            prefix, module = owner
            try:
                taken = module.load_checkpoint_tensor(name[len(prefix) + 1:], tensor)
            except ValueError as exc:
                raise WeightLoadError(f"{name}: {exc}") from exc
            if not taken:
                unexpected.append(name)
            continue
        for rule in stacked:
            if rule.ckpt_part + "." in name:
                fused = name.replace(rule.ckpt_part + ".", rule.fused_part + ".")
                mod_name, kind = fused.rsplit(".", 1)
                module = modules.get(mod_name)
                if not isinstance(module, CheckpointShards):
                    unexpected.append(name)
                    break
                try:
                    module.load_shard(rule.shard, kind, tensor)
                except ValueError as exc:  # misshapen shard, or a bias the layer does not have
                    raise WeightLoadError(f"{name}: {exc}") from exc
                seen_shards.setdefault(fused, set()).add(rule.shard)
                break
        else:
            param = params.get(name)
            if param is None:
                unexpected.append(name)
                continue
            if param.shape != tensor.shape:
                raise WeightLoadError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)
    for fused, shards in expected_shards.items():
        if seen_shards.get(fused) == shards:
            loaded.add(fused)
    for prefix in custom:
        loaded.update(p for p in params if p.startswith(prefix + "."))
    missing = sorted(set(params) - loaded)
    for prefix, module in custom.items():
        missing += [f"{prefix}.{n}" for n in module.missing_checkpoint_tensors()]
    if unexpected or missing:
        raise WeightLoadError(
            f"checkpoint does not match {type(model).__name__}: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )


def _custom_owner(name: str, custom: dict[str, nn.Module]) -> tuple[str, nn.Module] | None:
    """The innermost self-loading module whose path is a prefix of ``name``."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        module = custom.get(prefix)
        if module is not None:
            return prefix, module
    return None
