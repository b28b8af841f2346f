"""Expert placement for expert parallelism, and the EPLB policies that rebalance it from measured load.

With expert parallelism an instance's ``ranks`` ranks each hold ``slots`` *physical* experts per MoE layer
(``ranks * slots >= experts``); a physical slot holds one *logical* expert (a router's choice), and a logical
expert may have several replicas (the redundant slots, ``ranks * slots - experts`` of them). A step's tokens
routed to a logical expert with ``n`` replicas are dealt to its replicas in turn (the split every rank computes
the same way), so a replica's load is its expert's divided by ``n``, and a rank's is the sum over its slots.
The step waits for the most loaded rank: :func:`imbalance` (max / mean of the rank loads) is the figure the
policies lower.

The policies are DeepSeek's EPLB (its open ``eplb.py`` describes both):

- **global**: replicate the experts over all slots (each extra replica to the expert with the largest load per
  replica), then pack the replicas onto ranks, heaviest first, each to the least loaded rank with a free slot;
- **hierarchical** (``nodes > 1``, the experts' groups a multiple of the nodes): pack the routing groups onto
  nodes first (so group-limited routing keeps a token's experts within few nodes), then replicate and pack
  within each node as above;
- ``auto``: hierarchical where it applies, else global.

Pure logic over lists (no torch): the engine's EPLB controller (:mod:`xllm.core.eplb`) and the simulator
(:mod:`xllm.sim.moe`) call the same functions.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

EPLB_POLICIES = ("auto", "global", "hierarchical")


@dataclass(frozen=True)
class Placement:
    """Which logical expert every physical slot of every MoE layer holds: ``layers[l][r * slots + s]`` is
    the logical expert in slot ``s`` of rank ``r`` in MoE layer ``l`` (every logical expert at least once)."""

    experts: int
    ranks: int
    slots: int
    layers: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if self.experts < 1 or self.ranks < 1 or self.slots < 1:
            raise ValueError(f"a placement needs experts, ranks and slots >= 1, got {self.experts}, {self.ranks}, "
                             f"{self.slots}")
        if self.ranks * self.slots < self.experts:
            raise ValueError(f"{self.ranks} ranks x {self.slots} slots cannot hold {self.experts} experts")
        for i, phys in enumerate(self.layers):
            if len(phys) != self.ranks * self.slots:
                raise ValueError(f"layer {i}: {len(phys)} slots, expected {self.ranks * self.slots}")
            if set(phys) != set(range(self.experts)):
                raise ValueError(f"layer {i}: the slots do not hold every expert 0..{self.experts - 1} (or hold "
                                 "another)")

    @property
    def physical(self) -> int:
        """Physical slots per layer over all ranks."""
        return self.ranks * self.slots

    def rank_experts(self, layer: int, rank: int) -> tuple[int, ...]:
        """The logical experts in rank ``rank``'s slots of MoE layer ``layer``, in slot order."""
        return self.layers[layer][rank * self.slots:(rank + 1) * self.slots]

    def replicas(self, layer: int) -> list[list[int]]:
        """Per logical expert of ``layer``, its physical slots in increasing order (replica ``i`` of expert
        ``e`` is ``replicas(layer)[e][i]``)."""
        out: list[list[int]] = [[] for _ in range(self.experts)]
        for p, e in enumerate(self.layers[layer]):
            out[e].append(p)
        return out

    def words(self) -> list[int]:
        """The placement as integers (a step-plan message): experts, ranks, slots, layers, then the slots."""
        return [self.experts, self.ranks, self.slots, len(self.layers), *(e for phys in self.layers for e in phys)]

    @classmethod
    def from_words(cls, words: Sequence[int]) -> Placement:
        """The inverse of :meth:`words` (``ValueError`` for anything else)."""
        if len(words) < 4:
            raise ValueError("an expert placement needs at least 4 words")
        experts, ranks, slots, layers = (int(w) for w in words[:4])
        n = ranks * slots
        if n < 1 or len(words) != 4 + layers * n:
            raise ValueError(f"an expert placement of {layers} layers x {n} slots has {4 + layers * n} words, "
                             f"got {len(words)}")
        body = [int(w) for w in words[4:]]
        return cls(experts, ranks, slots, tuple(tuple(body[i * n:(i + 1) * n]) for i in range(layers)))


def slots_per_rank(experts: int, ranks: int, redundant: int = 0) -> int:
    """The physical slots each of ``ranks`` ranks holds for ``experts`` experts with at least ``redundant``
    extra replicas: ``ceil((experts + redundant) / ranks)`` (the rounding adds replicas, never drops one)."""
    if experts < 1 or ranks < 1 or redundant < 0:
        raise ValueError(f"need experts >= 1, ranks >= 1, redundant >= 0; got {experts}, {ranks}, {redundant}")
    return -(-(experts + redundant) // ranks)


def default_placement(layers: int, experts: int, ranks: int, redundant: int = 0) -> Placement:
    """The placement before any load is known: experts ``0..E-1`` in rank order (contiguous blocks), the
    extra slots replicas of experts ``0, 1, ...`` in turn."""
    slots = slots_per_rank(experts, ranks, redundant)
    phys = tuple(i % experts for i in range(ranks * slots))
    return Placement(experts, ranks, slots, tuple(phys for _ in range(layers)))


def rank_loads(load: Sequence[float], phys: Sequence[int], ranks: int) -> list[float]:
    """Expected load of each rank for one layer: expert ``e``'s ``load[e]`` split evenly over its replicas."""
    count: dict[int, int] = {}
    for e in phys:
        count[e] = count.get(e, 0) + 1
    slots = len(phys) // ranks
    return [sum(load[e] / count[e] for e in phys[r * slots:(r + 1) * slots]) for r in range(ranks)]


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of per-rank loads (1.0: perfectly balanced; 1.0 when nothing was routed)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total > 0 else 1.0


def placement_imbalance(load: Sequence[Sequence[float]], placement: Placement) -> float:
    """The mean over MoE layers of :func:`imbalance` of ``placement``'s rank loads under ``load`` ([layer][expert])."""
    if not placement.layers:
        return 1.0
    vals = [imbalance(rank_loads(load[i], phys, placement.ranks)) for i, phys in enumerate(placement.layers)]
    return sum(vals) / len(vals)


def rebalance(load: Sequence[Sequence[float]], ranks: int, slots: int, groups: int = 1, nodes: int = 1,
              policy: str = "auto") -> Placement:
    """A new placement for ``load`` (``[layer][expert]`` tokens routed, any non-negative weights) over ``ranks``
    ranks of ``slots`` slots (``nodes`` hosts of ``ranks / nodes`` ranks each; ``groups`` routing groups of
    experts), by ``policy`` (:data:`EPLB_POLICIES`, module docstring). Deterministic for the same input."""
    if policy not in EPLB_POLICIES:
        raise ValueError(f"policy must be one of {', '.join(EPLB_POLICIES)}, got {policy!r}")
    if not load:
        raise ValueError("rebalance needs the load of at least one layer")
    experts = len(load[0])
    hier = nodes > 1 and ranks % nodes == 0 and groups % nodes == 0 and experts % groups == 0
    if policy == "hierarchical" and not hier:
        raise ValueError(f"the hierarchical policy needs nodes > 1 dividing the ranks ({ranks}) and the expert "
                         f"groups ({groups}); got {nodes} nodes")
    if policy == "global" or not hier:
        layers = tuple(_global_layer(list(map(float, w)), ranks, slots) for w in load)
    else:
        layers = tuple(_hierarchical_layer(list(map(float, w)), ranks, slots, groups, nodes) for w in load)
    return Placement(experts, ranks, slots, layers)


def _replicate(load: list[float], physical: int) -> list[int]:
    """Replica counts per expert over ``physical`` slots: one each, then every extra replica to the expert with
    the largest load per replica (ties: the lower expert id)."""
    count = [1] * len(load)
    heap = [(-w, e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(physical - len(load)):
        _, e = heapq.heappop(heap)
        count[e] += 1
        heapq.heappush(heap, (-load[e] / count[e], e))
    return count


def _pack(weights: list[float], bins: int, capacity: int) -> list[list[int]]:
    """Items (by index) into ``bins`` bins of ``capacity`` items: heaviest first, each into the lightest bin with
    room (ties: the lower bin)."""
    out: list[list[int]] = [[] for _ in range(bins)]
    totals = [0.0] * bins
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        b = min((b for b in range(bins) if len(out[b]) < capacity), key=lambda b: (totals[b], b))
        out[b].append(i)
        totals[b] += weights[i]
    return out


def _global_layer(load: list[float], ranks: int, slots: int) -> tuple[int, ...]:
    count = _replicate(load, ranks * slots)
    items = [e for e, c in enumerate(count) for _ in range(c)]
    packed = _pack([load[e] / count[e] for e in items], ranks, slots)
    return tuple(items[i] for b in packed for i in sorted(b, key=lambda i: items[i]))


def _hierarchical_layer(load: list[float], ranks: int, slots: int, groups: int, nodes: int) -> tuple[int, ...]:
    per_group = len(load) // groups
    group_load = [sum(load[g * per_group:(g + 1) * per_group]) for g in range(groups)]
    node_groups = _pack(group_load, nodes, groups // nodes)
    ranks_per_node = ranks // nodes
    out: list[int] = []
    for gs in node_groups:
        experts = [g * per_group + j for g in sorted(gs) for j in range(per_group)]
        local = _global_layer([load[e] for e in experts], ranks_per_node, slots)
        out.extend(experts[i] for i in local)
    return tuple(out)
