"""Moving a running request off an instance (xLLM §3.5): copy its KV, or recompute it elsewhere?

Pure logic. A request that must leave an instance (it drains: scale-down, role flip, shutdown)
either migrates — its KV copied to the destination while it keeps decoding, then a stop of about
one step — or is recomputed there: its prompt and output so far prefilled again, after whatever
prefill work the destination has queued. :func:`move_cost` predicts both from measurements:
the KV bytes the destination lacks over the measured transfer bandwidth, against the tokens to
compute (queue included) over the destination's measured prefill speed. :class:`RateEstimate`
keeps such a measurement as an exponentially weighted mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MOVE_MODES = ("auto", "migrate", "recompute", "off")
"""How a gateway moves a draining instance's requests: by predicted cost, always one way, or not."""


@dataclass(frozen=True)
class MoveCost:
    """Predicted seconds of each way to move one request (``inf``: cannot be predicted), and what
    each would move: the KV bytes to send, the tokens to compute."""

    transfer_seconds: float
    recompute_seconds: float
    bytes_to_send: int = 0
    tokens_to_compute: int = 0

    @property
    def migrate(self) -> bool:
        """Whether copying the KV is predicted to be quicker than recomputing it."""
        return self.transfer_seconds <= self.recompute_seconds

    def describe(self) -> str:
        return f"transfer {_fmt(self.transfer_seconds)} vs recompute {_fmt(self.recompute_seconds)}"


def move_cost(kv_bytes: int, num_tokens: int, matched_tokens: int, bytes_per_s: float,
              queued_prefill_tokens: int, prefill_tokens_per_s: float, queued_bytes: int = 0) -> MoveCost:
    """The cost of moving a request holding ``num_tokens`` tokens of KV (``kv_bytes``) to an
    instance whose prefix cache holds its first ``matched_tokens`` (not sent, not recomputed),
    given the measured transfer bandwidth and the destination's measured prefill speed, its queued
    prefill work and the KV of other moves already under way (``queued_bytes``: they share the
    bandwidth). An unmeasured speed (<= 0) predicts ``inf`` for that way."""
    num_tokens = max(num_tokens, 1)
    missing = max(num_tokens - matched_tokens, 0)
    to_send = kv_bytes * missing / num_tokens
    transfer = (queued_bytes + to_send) / bytes_per_s if bytes_per_s > 0 else math.inf
    recompute = (queued_prefill_tokens + missing) / prefill_tokens_per_s if prefill_tokens_per_s > 0 else math.inf
    return MoveCost(transfer, recompute, int(to_send), missing)


@dataclass
class RateEstimate:
    """An exponentially weighted mean of a measured rate (``prior`` until the first sample)."""

    prior: float
    alpha: float = 0.3
    value: float | None = None
    samples: int = 0

    def observe(self, amount: float, seconds: float) -> None:
        """One measurement: ``amount`` (bytes, tokens) in ``seconds`` (ignored if not positive)."""
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.value = rate if self.value is None else (1 - self.alpha) * self.value + self.alpha * rate
        self.samples += 1

    @property
    def rate(self) -> float:
        return self.value if self.value is not None else self.prior


def _fmt(seconds: float) -> str:
    return "unknown" if math.isinf(seconds) else f"{seconds * 1e3:.1f} ms"
