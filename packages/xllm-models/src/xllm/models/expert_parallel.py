"""Expert parallelism over a tensor-parallel group, and its runtime rebalancing (EPLB) through double buffers.

With ``--enable-expert-parallel`` the MoE layers' routed experts are not split channel-wise over the ranks
(:mod:`xllm.models.tensor_parallel`): each rank holds ``slots`` *whole* experts per MoE layer, as an
:class:`~xllm.sched.eplb.Placement` says (redundant replicas of hot experts included). Attention, dense MLPs,
routers and shared experts keep their tensor-parallel split, so every rank sees every token's hidden state:
the routing is computed identically on every rank, each rank runs the (token, expert) pairs of the replicas it
holds (:func:`xllm.kernels.moe_expert_pairs`; an expert's replicas take its step's tokens in turn,
:meth:`ExpertMap.route`), and the all-reduce the layer runs anyway after its MLP combines the ranks' partial
outputs.

Rebalancing (:class:`ExpertLayers`, one per model): :meth:`ExpertLayers.prepare` builds the new placement's
experts into fresh buffers on a background thread (experts this rank already holds copied, the others read
from the checkpoint, :class:`CheckpointExperts`) while steps go on over the old ones; :meth:`ExpertLayers.commit`
then swaps every layer's weights and routing tables at once, between two steps (the EPLB controller,
:mod:`xllm.core.eplb`, commits on every rank in the same step once all are prepared). Rank 0 also counts the
tokens routed to each physical slot (:class:`ExpertLoad`), the load the controller rebalances by.
"""

from __future__ import annotations

import logging
import pathlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from xllm.sched.eplb import Placement, default_placement, slots_per_rank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertParallelSpec:
    """Expert parallelism's settings on a tensor-parallel shard: ``redundant`` extra replicas per layer beyond
    one per expert (``--num-redundant-experts``; the slots round up so every rank holds as many)."""

    redundant: int = 0

    def slots(self, experts: int, ranks: int) -> int:
        return slots_per_rank(experts, ranks, self.redundant)


class ExpertMap:
    """One MoE layer's placement as this rank routes by it: ``replicas`` ``[E, max replicas]`` physical slots
    (a row padded with its first), ``counts`` ``[E]``, and the logical experts of this rank's slots (``local``)."""

    def __init__(self, phys: Sequence[int], experts: int, rank: int, slots: int, device: torch.device) -> None:
        reps: list[list[int]] = [[] for _ in range(experts)]
        for p, e in enumerate(phys):
            reps[e].append(p)
        width = max(len(r) for r in reps)
        self.replicas = torch.tensor([r + [r[0]] * (width - len(r)) for r in reps], dtype=torch.int64, device=device)
        self.counts = torch.tensor([len(r) for r in reps], dtype=torch.int64, device=device)
        self.base, self.slots = rank * slots, slots
        self.local: tuple[int, ...] = tuple(phys[self.base:self.base + slots])

    def route(self, ids: torch.Tensor) -> torch.Tensor:
        """The physical slot of every (token, choice) of ``ids`` ``[T, k]`` (logical experts): the ``j``-th choice
        of expert ``e`` in the step (token-major order) goes to ``e``'s replica ``(j + e) % replicas``, so each
        replica computes an even share (within one) of its expert's tokens, the odd ones spread over the replicas
        by expert; every rank computes the same split."""
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        per_expert = torch.bincount(flat, minlength=self.counts.shape[0])
        starts = per_expert.cumsum(0) - per_expert
        occurrence = torch.empty_like(flat)
        occurrence[order] = torch.arange(flat.shape[0], device=flat.device) - starts[flat[order]]
        return self.replicas[flat, (occurrence + flat) % self.counts[flat]].view_as(ids)


class ExpertLoad:
    """Tokens routed to each physical slot of each MoE layer since the start (``counts`` ``[layers, slots]``),
    counted on rank 0 by every forward (the EPLB controller reads differences of :meth:`snapshot`)."""

    def __init__(self, layers: int, physical: int) -> None:
        self.counts = torch.zeros(layers, physical, dtype=torch.int64)

    def add(self, layer: int, phys: torch.Tensor) -> None:
        self.counts[layer] += torch.bincount(phys.reshape(-1).cpu(), minlength=self.counts.shape[1])

    def snapshot(self) -> list[list[int]]:
        return self.counts.tolist()


class CheckpointExperts:
    """Reads one expert's weights of one layer from the model directory's safetensors (memory-mapped; only that
    expert's bytes are read): the Hub's per-expert tensors or transformers 5's stacked ones."""

    def __init__(self, files: Sequence[pathlib.Path], dtype: torch.dtype) -> None:
        from safetensors import safe_open

        self.dtype = dtype
        self._files = {}
        self._where: dict[str, pathlib.Path] = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            self._files[f] = handle
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                self._where[name] = f

    def _get(self, name: str, index: int | None = None) -> torch.Tensor | None:
        f = self._where.get(name)
        if f is None:
            return None
        handle = self._files[f]
        t = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        return t.to(self.dtype)

    def read(self, prefix: str, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [2I, H], w2 [H, I])`` of expert ``expert`` under ``prefix`` (``model.layers.3.mlp.experts``);
        ``KeyError`` when the checkpoint has neither layout."""
        gate = self._get(f"{prefix}.{expert}.gate_proj.weight")
        if gate is not None:
            up, down = self._get(f"{prefix}.{expert}.up_proj.weight"), self._get(f"{prefix}.{expert}.down_proj.weight")
            if up is None or down is None:
                raise KeyError(f"{prefix}.{expert}: the checkpoint lacks its up_proj or down_proj")
            return torch.cat([gate, up], 0), down
        w13, w2 = self._get(f"{prefix}.gate_up_proj", expert), self._get(f"{prefix}.down_proj", expert)
        if w13 is None or w2 is None:
            raise KeyError(f"{prefix}: the checkpoint has no weights of expert {expert}")
        return w13, w2


@dataclass
class _Staged:
    """A prepared placement: every layer's new weights and map (built by the prepare thread)."""

    placement: Placement
    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
    maps: list[ExpertMap]
    seconds: float = 0.0


class ExpertLayers:
    """The model's expert-parallel MoE layers (``modules``: its :class:`~xllm.models.moe.RoutedExperts` in layer
    order, ``prefixes`` their checkpoint names) on rank ``rank`` of ``ranks``: the current :attr:`placement`, the
    load counted on rank 0 (:attr:`load`), and the double-buffered switch to a new placement (module docstring).
    ``prepare`` / ``prepared`` / ``commit`` are called from the thread that runs the steps."""

    def __init__(self, modules: Sequence, prefixes: Sequence[str], rank: int, ranks: int, placement: Placement,
                 source: CheckpointExperts | None, groups: int = 1) -> None:
        self.modules, self.prefixes = list(modules), list(prefixes)
        self.groups = groups  # the routing groups of the experts (DeepSeek's n_group; 1: none)
        self.rank, self.ranks = rank, ranks
        self.placement = placement
        self.source = source
        self.load = ExpertLoad(len(self.modules), placement.physical) if rank == 0 else None
        self.switches = 0
        self._staged: _Staged | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        for i, m in enumerate(self.modules):
            m.place(ExpertMap(placement.layers[i], placement.experts, rank, placement.slots, m.w13.device), i,
                    self.load)

    def prepare(self, placement: Placement) -> None:
        """Start building ``placement``'s experts of this rank into new buffers (a background thread); the
        current ones serve until :meth:`commit`. ``ValueError`` for a placement of another shape; RuntimeError
        while another is being prepared or without a checkpoint to read experts from."""
        p = self.placement
        if (placement.experts, placement.ranks, placement.slots, len(placement.layers)) != \
                (p.experts, p.ranks, p.slots, len(p.layers)):
            raise ValueError("the new expert placement has another shape than the current one")
        if self._thread is not None:
            raise RuntimeError("an expert placement is already being prepared")
        self._staged, self._error = None, None
        self._thread = threading.Thread(target=self._build, args=(placement,), name="xllm-eplb-prepare", daemon=True)
        self._thread.start()

    def _build(self, placement: Placement) -> None:
        start = time.perf_counter()
        try:
            w13s, w2s, maps = [], [], []
            for i, m in enumerate(self.modules):
                new = ExpertMap(placement.layers[i], placement.experts, self.rank, placement.slots, m.w13.device)
                held = {e: s for s, e in enumerate(m.expert_map.local)}
                w13, w2 = torch.empty_like(m.w13), torch.empty_like(m.w2)
                for s, e in enumerate(new.local):
                    if e in held:  # already here: copied from the serving buffer (read only meanwhile)
                        w13[s].copy_(m.w13[held[e]])
                        w2[s].copy_(m.w2[held[e]])
                    else:
                        if self.source is None:
                            raise RuntimeError("no checkpoint to read experts from (a GGUF model cannot rebalance)")
                        a, b = self.source.read(self.prefixes[i], e)
                        w13[s].copy_(a)
                        w2[s].copy_(b)
                w13s.append(w13)
                w2s.append(w2)
                maps.append(new)
            self._staged = _Staged(placement, w13s, w2s, maps, time.perf_counter() - start)
        except BaseException as e:  # reported by prepared()/commit() on the step thread
            self._error = e

    def prepared(self) -> bool:
        """Whether the placement being prepared is ready to commit (re-raises the thread's failure)."""
        if self._thread is None or self._thread.is_alive():
            return False
        if self._error is not None:
            err, self._error, self._thread = self._error, None, None
            raise RuntimeError(f"preparing the new expert placement failed: {err}") from err
        return self._staged is not None

    def commit(self) -> float:
        """Swap every layer to the prepared placement (between steps); the seconds preparing took."""
        if not self.prepared():
            raise RuntimeError("commit: no prepared expert placement")
        staged = self._staged
        for i, m in enumerate(self.modules):
            m.swap(staged.w13[i], staged.w2[i], staged.maps[i])
        self.placement = staged.placement
        self._staged, self._thread = None, None
        self.switches += 1
        log.info("rank %d: expert placement switched (%d; prepared in %.2fs)", self.rank, self.switches,
                 staged.seconds)
        return staged.seconds


class ExpertParallelHost:
    """Mixin of the MoE model classes: :attr:`expert_plane` is the model's :class:`ExpertLayers` once
    :meth:`attach_experts` placed its experts (None: not expert-parallel)."""

    expert_plane: ExpertLayers | None = None

    def attach_experts(self, rank: int, ranks: int, redundant: int, source: CheckpointExperts | None) -> ExpertLayers:
        """Place the expert-parallel MoE layers (built with their slots) by the default placement, before the
        weights load (each layer then loads the experts its slots hold)."""
        from xllm.models.moe import RoutedExperts

        found = [(name, m) for name, m in self.named_modules() if isinstance(m, RoutedExperts) and m.slots]  # type: ignore[attr-defined]
        if not found:
            raise ValueError("the model has no expert-parallel MoE layers")
        experts = found[0][1].num_experts
        placement = default_placement(len(found), experts, ranks, redundant)
        groups = int(self.cfg.get("n_group") or 1)  # type: ignore[attr-defined]
        # (a module's path is its tensors' checkpoint prefix: model.layers.3.mlp.experts)
        self.expert_plane = ExpertLayers([m for _, m in found], [n for n, _ in found], rank, ranks, placement, source,
                                         groups)
        return self.expert_plane
