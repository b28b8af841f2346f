"""A circuit breaker per instance: routing never reselects an instance that keeps failing.

States (as in the classic pattern):

- **closed**: the instance takes requests. A failure (unreachable, hung, crashed, draining)
  opens the breaker.
- **open**: no request is routed there for ``backoff`` seconds; the backoff doubles with each
  consecutive failure (``base_backoff`` .. ``max_backoff``).
- **half-open**: the backoff is over. One probe (a ``Health`` call made by the gateway, never a
  client's request) decides: healthy closes the breaker, anything else opens it again with the
  doubled backoff. While the probe runs the instance takes nothing.

A request served successfully (its first token arrived) resets the consecutive-failure count.
The breaker is state only; :class:`xllm.gateway.registry.Registry` runs the probes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    """One instance's breaker (times on the registry's monotonic clock)."""

    base_backoff: float = 1.0
    max_backoff: float = 30.0
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0           # consecutive failures
    open_until: float = 0.0
    trips: int = 0              # times it opened (for metrics and tests)

    @property
    def closed(self) -> bool:
        """Whether requests may be routed there."""
        return self.state is BreakerState.CLOSED

    def probe_due(self, now: float) -> bool:
        """Open and its backoff is over: time for a half-open probe."""
        return self.state is BreakerState.OPEN and now >= self.open_until

    def failure(self, now: float) -> None:
        self.failures += 1
        self.state = BreakerState.OPEN
        self.open_until = now + self.backoff
        self.trips += 1

    def success(self) -> None:
        self.failures = 0
        self.state = BreakerState.CLOSED

    def start_probe(self) -> None:
        self.state = BreakerState.HALF_OPEN

    def probe_result(self, healthy: bool, now: float) -> None:
        if healthy:
            self.success()
        else:
            self.failure(now)

    @property
    def backoff(self) -> float:
        return min(self.base_backoff * 2 ** max(self.failures - 1, 0), self.max_backoff)
