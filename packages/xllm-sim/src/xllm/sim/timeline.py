"""A run's timeline for the gateway's live cluster page to replay (``xllm-sim run --json OUT --timeline S``).

Every ``interval_s`` simulated seconds a frame records each instance's role (a flip under way as
``<from>_to_<to>``), running and waiting sequences and KV memory use; role flips and moves are recorded
as they happen, with the keys the live gateway publishes them with (``xllm.gateway.dashboard``:
``role_flip_started`` / ``role_flip_finished`` with ``instance``, ``from_role``, ``to_role``, ``trigger``,
``reason``; ``move_started`` / ``move_finished`` with ``request_id``, ``source``, ``destination``,
``how``, ``outcome``), so the page draws a simulated cluster with the code that draws a live one.
The latency figures of each frame (TTFT of the requests whose first token came in it, TPOT of the
ones that finished in it, p50 and p99, seconds) are filled in at the end, in one pass over the requests.

The JSON form (:meth:`Timeline.to_dict`)::

    {"interval_s": 1.0, "instances": ["e0", ...],
     "frames": [{"t": 1.0, "role": ["prefill", "decode_to_prefill", ...], "running": [...], "waiting": [...],
                 "kv": [0.12, ...], "arrived": 40, "finished": 31,
                 "ttft_p50": 0.21, "ttft_p99": 0.9, "tpot_p50": 0.03, "tpot_p99": 0.05}, ...],
     "events": [{"t": 3.5, "kind": "role_flip_started", "instance": "e3", ...}, ...]}
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

from xllm.sim.metrics import percentile

if TYPE_CHECKING:
    from xllm.sim.instance import SimInstance
    from xllm.sim.metrics import Request


def pool_of(inst: SimInstance) -> str:
    """The instance's role, or ``<from>_to_<to>`` while it flips (the gateway's pool names)."""
    return inst.role if inst.flipping is None else f"{inst.role}_to_{inst.flipping}"


class Timeline:
    """Frames and events of one run (see the module docstring)."""

    def __init__(self, instances: Sequence[SimInstance], interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"the timeline interval must be positive, got {interval_s!r}")
        self.instances = list(instances)
        self.interval_s = interval_s
        self.frames: list[dict] = []
        self.events: list[dict] = []

    def sample(self, now: float) -> None:
        """Record a frame of every instance's state at ``now``."""
        insts = self.instances
        self.frames.append({"t": round(now, 6), "role": [pool_of(i) for i in insts],
                            "running": [len(i.running) for i in insts],
                            "waiting": [len(i.waiting) + len(i.reserving) for i in insts],
                            "kv": [round(i.kv.usage, 4) for i in insts]})

    def event(self, now: float, kind: str, **data: object) -> None:
        """Record ``kind`` (a flip or a move) at ``now`` with the live page's keys."""
        self.events.append({"t": round(now, 6), "kind": kind, **data})

    def to_dict(self, requests: Sequence[Request] = ()) -> dict:
        """The JSON form, each frame's request counts and latencies taken from ``requests``."""
        times = [f["t"] for f in self.frames]
        n = len(times)
        arrived, finished = [0] * n, [0] * n
        ttfts: list[list[float]] = [[] for _ in range(n)]
        tpots: list[list[float]] = [[] for _ in range(n)]

        def slot(t: float) -> int | None:
            i = bisect.bisect_left(times, t)  # the first frame at or after t holds it
            return i if i < n else None

        for r in requests:
            if (i := slot(r.spec.arrival)) is not None:
                arrived[i] += 1
            if r.first_token is not None and (i := slot(r.first_token)) is not None:
                ttfts[i].append(r.ttft)
            if r.finish is not None and (i := slot(r.finish)) is not None:
                finished[i] += 1
                if (tpot := r.tpot) is not None:
                    tpots[i].append(tpot)
        frames = []
        done = came = 0
        for i, frame in enumerate(self.frames):
            came += arrived[i]
            done += finished[i]
            frames.append({**frame, "arrived": came, "finished": done,
                           "ttft_p50": _pct(ttfts[i], 50), "ttft_p99": _pct(ttfts[i], 99),
                           "tpot_p50": _pct(tpots[i], 50), "tpot_p99": _pct(tpots[i], 99)})
        return {"interval_s": self.interval_s, "instances": [i.instance_id for i in self.instances],
                "frames": frames, "events": list(self.events)}


def _pct(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 6) if values else None
