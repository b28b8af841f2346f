"""The step watchdog: an engine thread stuck in one step, told from a slow step and taken for hung.

An engine that has had work without completing a step for longer than its bound (the larger of the
``stall_timeout`` floor and :data:`STEP_MARGIN` times the longest step so far: a big prefill raises it) is
declared hung (:meth:`AsyncEngine.declare_hung <xllm.core.async_engine.AsyncEngine.declare_hung>`): its
streams fail as in a crash and it refuses new requests. The engine service of an instance process
(:class:`xllm.engine.server.EngineServer`) and the single-process server (:mod:`xllm.gateway.embedded`) run
one each; what happens to the process after the verdict is theirs (``on_hung``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from xllm.core.async_engine import AsyncEngine

STEP_MARGIN = 4.0  # a step may run this many times the longest one completed so far


class StepWatchdog:
    """Watches one :class:`AsyncEngine` from an event loop (:meth:`start` on it, :meth:`stop`).

    ``stall_timeout``: the bound's floor in seconds; 0 turns the watchdog off (:meth:`start` does nothing,
    :meth:`problem` reports only a dead engine). It counts the time it saw the same step running itself,
    each look adding at most two intervals: a process stopped as a whole (SIGSTOP, then SIGCONT) or an event
    loop held up is not taken for a stuck engine thread."""

    def __init__(self, engine: AsyncEngine, stall_timeout: float = 60.0) -> None:
        self.engine = engine
        self.stall_timeout = stall_timeout
        self._task: asyncio.Task | None = None

    def step_bound(self) -> float:
        """Seconds a step may run before the engine is taken for hung."""
        return max(self.stall_timeout, STEP_MARGIN * self.engine.longest_step)

    def problem(self) -> str:
        """Why the engine cannot serve ("" while it can): its loop died (or this watchdog took it for hung), or
        one step has been running for more than :meth:`step_bound` seconds (not yet a verdict)."""
        if not self.engine.is_running:
            return self.engine.dead_reason or "engine stopped"
        stalled = self.engine.stalled_for()
        if self.stall_timeout > 0 and stalled > self.step_bound():
            return f"engine step running for {stalled:.0f} s"
        return ""

    def start(self, on_hung: Callable[[str], object] | None = None) -> None:
        """Start watching on the running loop (no-op when off or started); ``on_hung(reason)`` runs on the loop
        once the verdict is in."""
        if self.stall_timeout > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(on_hung))

    def stop(self) -> None:
        """Stop watching (idempotent)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self, on_hung: Callable[[str], object] | None) -> None:
        interval = min(1.0, self.stall_timeout / 4)
        stuck, seen, last = 0.0, -1, time.monotonic()
        while self.engine.is_running:
            await asyncio.sleep(interval)
            now, busy, steps = time.monotonic(), self.engine.stalled_for(), self.engine.steps_done
            stuck = 0.0 if busy == 0 or steps != seen else stuck + min(now - last, 2 * interval)
            seen, last = steps, now
            bound = self.step_bound()
            if stuck > bound:
                reason = f"engine hung: no step completed for {busy:.1f} s with work pending (bound {bound:.1f} s)"
                if self.engine.declare_hung(reason) and on_hung is not None:
                    on_hung(reason)
                return
