"""The simulation clock and its event queue.

Events are ``(time, sequence number, kind, payload)`` on a binary heap: equal times run in the
order they were scheduled, so a run is deterministic. Request arrivals are not queued here (the
cluster reads them lazily from the trace, one ahead); at equal times queued events run before the
arrival.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

# event kinds
STEP_END = 0       # payload: SimInstance
DISPATCH = 1       # payload: Request (after the gateway's overhead)
TRANSFER_DONE = 2  # payload: Transfer
HEARTBEAT = 3      # payload: instance index
PD_TICK = 4        # payload: None
MOVE_DONE = 5      # payload: Move
TIMELINE = 6       # payload: None (a frame of the run's timeline, xllm.sim.timeline)


class EventQueue:
    """A clock (``now``) and the events scheduled after it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.processed = 0

    def at(self, time: float, kind: int, payload: Any = None) -> None:
        """Schedule an event at ``time`` (never before ``now``)."""
        heapq.heappush(self.heap, (max(time, self.now), next(self._seq), kind, payload))

    def pop(self) -> tuple[float, int, Any]:
        """The next event (the clock moves to its time)."""
        time, _, kind, payload = heapq.heappop(self.heap)
        self.now = time
        self.processed += 1
        return time, kind, payload

    def next_time(self) -> float | None:
        return self.heap[0][0] if self.heap else None
