"""Expert-parallel load balancing at run time (EPLB, xLLM §4.4.2): rank 0 measures, decides and switches every
rank's expert placement between two steps, without pausing serving.

The model's expert-parallel layers (an :class:`ExpertPlane`, :class:`xllm.models.expert_parallel.ExpertLayers`)
count on rank 0 the tokens routed to each physical slot. Every ``interval`` steps the :class:`EplbController`
closes a window: it reports the window's measured balance (:class:`~xllm.engine_api.stats.ExpertBalance`: the
max / mean of the tokens each rank's experts computed, averaged over the MoE layers) and, with EPLB on, computes
a new placement (:func:`xllm.sched.eplb.rebalance`) when the measured imbalance is above ``trigger``, for the
load of the windows so far, each older window's weight halved (a short window alone is noisy: placements would
chase it). Where that lowers the predicted imbalance by more than ``min_gain``, the switch runs in three phases:

1. ``EPLB_PREPARE`` (the placement's words) to every rank: each builds its new experts into spare buffers on a
   background thread (:meth:`ExpertPlane.prepare`) while steps go on over the current ones;
2. once rank 0's own buffers are ready, before a step, ``EPLB_COMMIT``: every rank adds its readiness (1 or 0)
   in one all-reduce, so every rank sees the same count;
3. all ready: every rank swaps in the new placement (:meth:`ExpertPlane.commit`) before that step's forward;
   otherwise the poll repeats before a later step.

The placement never changes within a forward, and each token's experts and weights are the router's whatever
the placement (only which rank computes them changes), so outputs equal those of any other placement up to
the order of the ranks' partial sums. Worker ranks run :func:`serve_eplb_message`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from xllm.engine_api.stats import ExpertBalance
from xllm.sched.eplb import Placement, imbalance, placement_imbalance, rebalance

if TYPE_CHECKING:
    from xllm.core.executor.group import RankGroup
    from xllm.core.parallel.comm import Communicator

log = logging.getLogger(__name__)

EPLB_PREPARE = 19  # plan-channel kind: int64 placement words (xllm.sched.eplb.Placement.words)
EPLB_COMMIT = 20  # plan-channel kind: every rank all-reduces its readiness and switches when all are ready
HISTORY_DECAY = 0.5  # the weight of the load before a window in the load a decision balances


class ExpertLoadCounts(Protocol):
    """Tokens routed to each physical slot of each MoE layer since the start (rank 0)."""

    def snapshot(self) -> list[list[int]]: ...


class ExpertPlane(Protocol):
    """A model's expert-parallel layers, as the EPLB controller drives them (:mod:`xllm.models.expert_parallel`)."""

    placement: Placement
    load: ExpertLoadCounts | None
    groups: int  # the experts' routing groups (1: none), which the hierarchical policy packs by

    def prepare(self, placement: Placement) -> None: ...

    def prepared(self) -> bool: ...

    def commit(self) -> float: ...


@dataclass(frozen=True)
class EplbSettings:
    """``enabled`` (``--enable-eplb``): rebalance automatically; ``interval`` (``--eplb-step-interval``): steps per
    window; ``policy`` (``--eplb-policy``, :data:`xllm.sched.eplb.EPLB_POLICIES`); ``min_gain``: the predicted
    drop of the max / mean load a switch must bring; ``trigger``: the window's measured max / mean above which a
    switch is considered (below it the placement is kept: windows of a few steps are noisy); ``nodes``: the hosts
    the hierarchical policy packs by."""

    enabled: bool = False
    interval: int = 1000
    policy: str = "auto"
    min_gain: float = 0.05
    trigger: float = 1.1
    nodes: int = 1


class EplbController:
    """Rank 0's EPLB over ``plane`` on ``group``'s ranks (module docstring). :meth:`before_step` and
    :meth:`after_step` run around every step under the runner's lock; :meth:`request` forces a switch (to a
    given placement, or to the policy's for the load since the last window) at the next step. Owns the
    figures it decides by: :attr:`rebalances`, :attr:`imbalance` (the last window's), the window reports."""

    def __init__(self, plane: ExpertPlane, group: RankGroup, settings: EplbSettings) -> None:
        if plane.load is None:
            raise ValueError("the EPLB controller runs on rank 0 (the plane that counts the load)")
        self.plane, self.group, self.settings = plane, group, settings
        self.rebalances = 0
        self.switch_steps: list[int] = []  # the steps before which each switch took effect
        self.imbalance = 1.0
        self.steps = 0
        self._mark = plane.load.snapshot()
        self._since = 0
        self._pending: Placement | None = None
        self._forced: Placement | bool = False
        self._report: ExpertBalance | None = None
        self._history: list[list[float]] | None = None  # the windows' logical loads, older ones decayed

    def request(self, placement: Placement | None = None) -> None:
        """Switch to ``placement`` (None: the policy's placement for the load since the last window) at the
        next step, whatever the gain."""
        self._forced = placement if placement is not None else True

    def take_report(self) -> ExpertBalance | None:
        """The report of a window closed since the last call (None: none)."""
        report, self._report = self._report, None
        return report

    def before_step(self) -> None:
        if self._pending is not None:
            self._try_commit()
        elif self._forced is not False or self._since >= self.settings.interval:
            self._close_window()

    def after_step(self) -> None:
        self.steps += 1
        self._since += 1

    def _window(self) -> tuple[list[list[int]], list[list[float]]]:
        """The window's tokens per physical slot and per logical expert, per MoE layer."""
        mark = self._mark
        now = self._start_window()
        phys = [[a - b for a, b in zip(n, m, strict=True)] for n, m in zip(now, mark, strict=True)]
        p = self.plane.placement
        logical = [[0.0] * p.experts for _ in p.layers]
        for i, layer in enumerate(phys):
            for slot, n in enumerate(layer):
                logical[i][p.layers[i][slot]] += n
        return phys, logical

    def _start_window(self) -> list[list[int]]:
        """A new window from now (after a window closed, or a switch: the slots hold other experts); the counts."""
        self._mark, self._since = self.plane.load.snapshot(), 0  # type: ignore[union-attr]
        return self._mark

    def _close_window(self) -> None:
        phys, load = self._window()
        p = self.plane.placement
        measured = [imbalance([sum(layer[r * p.slots:(r + 1) * p.slots]) for r in range(p.ranks)]) for layer in phys]
        self.imbalance = sum(measured) / len(measured) if measured else 1.0
        tokens = [int(sum(layer[e] for layer in load)) for e in range(p.experts)]
        forced, self._forced = self._forced, False
        h = self._history = load if self._history is None else _decayed(self._history, load)
        switch = None
        if isinstance(forced, Placement):
            switch = forced
        elif (forced or (self.settings.enabled and self.imbalance > self.settings.trigger)) and sum(tokens):
            s = self.settings
            new = rebalance(h, p.ranks, p.slots, self.plane.groups, s.nodes, s.policy)
            if forced or (placement_imbalance(h, p) - placement_imbalance(h, new) > s.min_gain and new != p):
                switch = new
        self._report = ExpertBalance(self.imbalance, tokens, switching=switch is not None,
                                     rebalances=self.rebalances, layer_tokens=[[int(n) for n in x] for x in load])
        if switch is not None:
            log.info("EPLB: switching the expert placement (window imbalance %.3f, predicted %.3f)", self.imbalance,
                     placement_imbalance(h, switch))
            self._publish(EPLB_PREPARE, np.asarray(switch.words(), dtype=np.int64))
            self.plane.prepare(switch)
            self._pending = switch

    def _try_commit(self) -> None:
        if not self.plane.prepared():  # (re-raises a failed preparation: the engine stops, as for a failed step)
            return
        self._publish(EPLB_COMMIT, np.zeros(1, dtype=np.int64))
        if _all_ready(True, self.group.comm):
            self.plane.commit()
            self._pending = None
            self.rebalances += 1
            self.switch_steps.append(self.steps)
            self._start_window()

    def _publish(self, kind: int, words: np.ndarray) -> None:
        g = self.group
        g.channel.publish(kind, words, g.timeout_s, g.check)


def _decayed(history: list[list[float]], load: list[list[float]]) -> list[list[float]]:
    """``history`` weighted by :data:`HISTORY_DECAY` plus the new window's ``load`` (per layer and expert)."""
    return [[HISTORY_DECAY * a + b for a, b in zip(x, y, strict=True)] for x, y in zip(history, load, strict=True)]


def _all_ready(ready: bool, comm: Communicator) -> bool:
    """Every rank's readiness summed (one all-reduce; every rank gets the same answer)."""
    flag = torch.tensor([1.0 if ready else 0.0])
    return int(comm.all_reduce(flag).item()) == comm.size


def serve_eplb_message(kind: int, words: np.ndarray, plane: ExpertPlane | None, comm: Communicator) -> None:
    """A worker rank's side of an ``EPLB_*`` message (module docstring)."""
    if plane is None:
        raise RuntimeError(f"rank {comm.rank}: an EPLB message for a model without expert-parallel layers")
    if kind == EPLB_PREPARE:
        plane.prepare(Placement.from_words(words.tolist()))
        return
    if _all_ready(plane.prepared(), comm):
        plane.commit()
