"""Expert parallelism in the simulator: each MoE step's expert work per rank and the straggler wait it causes,
with the default placement or with EPLB, at any number of ranks, decided by the engine's own policy code
(:mod:`xllm.sched.eplb`).

A trace is a list of windows, each the tokens routed to every logical expert of every MoE layer in that window
(``[window][layer][expert]``: what the engine's load windows measure, :class:`xllm.engine_api.stats.ExpertBalance`,
or :func:`synthetic_trace`). A rank's work in a layer is the load of the experts it holds, each expert's load split
evenly over its replicas (:func:`xllm.sched.eplb.rank_loads`); the layer waits for its most loaded rank, so the
straggler wait of a layer is ``max - mean`` of the rank loads (in tokens; times ``us_per_token`` in time). With
EPLB the placement for window ``w + 1`` is the policy's placement for window ``w``'s load (the engine switches
after a window closes), starting from :func:`xllm.sched.eplb.default_placement`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from xllm.sched.eplb import default_placement, imbalance, rank_loads, rebalance


@dataclass
class EPResult:
    """One simulated configuration over a trace: per window, the mean over layers of the rank loads' max / mean
    (``imbalance``) and the straggler wait summed over layers (``wait_tokens``, token-expert pairs the average
    rank idles for)."""

    ranks: int
    redundant: int
    eplb: bool
    imbalance: list[float] = field(default_factory=list)
    wait_tokens: list[float] = field(default_factory=list)
    busy_tokens: list[float] = field(default_factory=list)  # the most loaded rank's work, summed over layers

    def mean_imbalance(self, start: int = 0) -> float:
        """The mean of the windows' imbalance from window ``start`` on (1.0: none)."""
        xs = self.imbalance[start:]
        return sum(xs) / len(xs) if xs else 1.0

    def wait(self, start: int = 0) -> float:
        """The straggler wait summed over the windows from ``start`` on (token-expert pairs)."""
        return sum(self.wait_tokens[start:])

    def wait_fraction(self, start: int = 0) -> float:
        """The share of the MoE layers' time the average rank waits for the slowest, from window ``start`` on
        (0: balanced; EPLB's first window runs the default placement, so comparisons start at 1)."""
        busy = sum(self.busy_tokens[start:])
        return self.wait(start) / busy if busy else 0.0


def simulate_ep(trace: Sequence[Sequence[Sequence[float]]], ranks: int, redundant: int = 0, eplb: bool = False,
                policy: str = "auto", groups: int = 1, nodes: int = 1) -> EPResult:
    """``trace`` (module docstring) over ``ranks`` ranks with ``redundant`` extra replicas, EPLB on or off."""
    if not trace:
        raise ValueError("simulate_ep needs at least one window")
    layers, experts = len(trace[0]), len(trace[0][0])
    placement = default_placement(layers, experts, ranks, redundant)
    out = EPResult(ranks, redundant, eplb)
    for load in trace:
        imb, wait, busy = [], 0.0, 0.0
        for i, phys in enumerate(placement.layers):
            loads = rank_loads(load[i], phys, ranks)
            imb.append(imbalance(loads))
            wait += max(loads) - sum(loads) / ranks
            busy += max(loads)
        out.imbalance.append(sum(imb) / len(imb))
        out.wait_tokens.append(wait)
        out.busy_tokens.append(busy)
        if eplb:
            placement = rebalance(load, ranks, placement.slots, groups, nodes, policy)
    return out


def synthetic_trace(windows: int, layers: int, experts: int, tokens: int, top_k: int, skew: float, drift: float,
                    seed: int = 0) -> list[list[list[float]]]:
    """A skewed, slowly drifting expert load: each layer ranks its experts in a random order and gives the
    ``j``-th a Zipf share ``1 / (j + 1) ** skew`` of ``tokens * top_k`` choices per window; between windows a
    ``drift`` share of the order's neighbours swap (hot experts cool down, others heat up)."""
    rng = random.Random(seed)
    orders = []
    for _ in range(layers):
        order = list(range(experts))
        rng.shuffle(order)
        orders.append(order)
    weights = [1.0 / (j + 1) ** skew for j in range(experts)]
    norm = sum(weights)
    trace = []
    for _ in range(windows):
        window = []
        for order in orders:
            load = [0.0] * experts
            for j, e in enumerate(order):
                load[e] = tokens * top_k * weights[j] / norm
            window.append(load)
            for _ in range(math.ceil(drift * experts)):
                j = rng.randrange(experts - 1)
                order[j], order[j + 1] = order[j + 1], order[j]
        trace.append(window)
    return trace
