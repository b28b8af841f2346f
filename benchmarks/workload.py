"""What to send and when: request lengths, arrival processes and trace files.

Pure Python. Every generator takes a seed so two systems get the same workload.

- Arrivals are offsets in seconds from the start of a run: Poisson (exponential gaps),
  Gamma (bursty when the coefficient of variation of the gaps is > 1), all-at-once, or a trace.
- Length specs: ``"32"`` (fixed), ``"uniform:16:64"`` (inclusive), ``"lognormal:MEAN:SIGMA[:MAX]"``
  (mean in tokens, sigma of the underlying normal; clipped to [1, MAX]).
- Trace files: one request per line, ``arrival,prompt_len,output_len`` (CSV, optional header,
  ``#`` comments) or JSON lines ``{"arrival": s, "prompt_len": n, "output_len": m}``.
"""

from __future__ import annotations

import json
import math
import pathlib
import random
from dataclasses import dataclass

from xllm.sim.trace import LengthDist as SimLengthDist
from xllm.sim.trace import TraceError as SimTraceError


class TraceError(ValueError):
    """A trace file line that cannot be used; the message names the file and line."""


class SpecError(ValueError):
    """A length-distribution spec that cannot be parsed."""


# ---- arrivals -------------------------------------------------------------------------------------

def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """Arrival offsets of a Poisson process of ``rate`` requests/s: exponential gaps, first at ~gap."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def gamma_arrivals(rate: float, cv: float, n: int, seed: int = 0) -> list[float]:
    """Arrival offsets with Gamma-distributed gaps of mean ``1/rate`` and coefficient of variation ``cv``.

    ``cv`` = 1 is Poisson; ``cv`` > 1 is bursty (clusters of arrivals separated by long gaps).
    Shape k = 1/cv², scale = 1/(rate·k).
    """
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be > 0, got rate={rate} cv={cv}")
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(shape, scale)
        out.append(t)
    return out


def burst_arrivals(n: int) -> list[float]:
    """Every request at t=0 (a closed batch; a concurrency limit paces them)."""
    return [0.0] * n


def gaps(arrivals: list[float]) -> list[float]:
    """Inter-arrival gaps (the first measured from 0)."""
    return [b - a for a, b in zip([0.0, *arrivals[:-1]], arrivals)]


# ---- lengths ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts, from a spec string (see the module docstring). The syntax and
    the draws are xllm-sim's (:class:`xllm.sim.trace.LengthDist`, one parser for both)."""

    dist: SimLengthDist
    spec: str

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        try:
            return cls(SimLengthDist.parse(spec), str(spec).strip())
        except SimTraceError as exc:
            raise SpecError(str(exc)) from None

    @property
    def kind(self) -> str:
        return self.dist.kind

    @property
    def params(self) -> tuple[float, ...]:
        return self.dist.params

    def sample(self, n: int, seed: int = 0) -> list[int]:
        rng = random.Random(seed)
        return [self.dist.draw(rng) for _ in range(n)]

    @property
    def max(self) -> int:
        return int(self.params[0] if self.kind == "fixed" else self.params[1] if self.kind == "uniform"
                   else self.params[2])


# ---- traces ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceEntry:
    arrival: float     # seconds from the start of the trace
    prompt_len: int
    output_len: int


def parse_trace(text: str, source: str = "<trace>") -> list[TraceEntry]:
    """Parse a trace (CSV or JSON lines, see the module docstring); arrivals are re-based to start at 0.

    Raises :class:`TraceError` naming ``source:line`` for a malformed line, a negative arrival,
    a length < 1 or arrivals that go backwards.
    """
    entries: list[TraceEntry] = []
    header_seen = False
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{lineno}"
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise TraceError(f"{where}: invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object")
            missing = [k for k in ("arrival", "prompt_len", "output_len") if k not in obj]
            if missing:
                raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
            fields = [obj["arrival"], obj["prompt_len"], obj["output_len"]]
        else:
            fields = [f.strip() for f in line.replace("\t", ",").split(",")]
            if len(fields) == 1:
                fields = line.split()
            if not entries and not header_seen and fields and fields[0].lower() in ("arrival", "timestamp", "time"):
                header_seen = True
                continue
            if len(fields) != 3:
                raise TraceError(f"{where}: expected 3 fields (arrival, prompt_len, output_len), got {len(fields)}")
        entries.append(_entry(fields, where))
        if len(entries) > 1 and entries[-1].arrival < entries[-2].arrival:
            raise TraceError(f"{where}: arrival {entries[-1].arrival} is before the previous one "
                             f"({entries[-2].arrival}); sort the trace by arrival")
    if not entries:
        raise TraceError(f"{source}: no requests in the trace")
    t0 = entries[0].arrival
    return [TraceEntry(e.arrival - t0, e.prompt_len, e.output_len) for e in entries]


def _entry(fields: list, where: str) -> TraceEntry:
    try:
        arrival = float(fields[0])
    except (TypeError, ValueError):
        raise TraceError(f"{where}: arrival {fields[0]!r} is not a number") from None
    if not math.isfinite(arrival) or arrival < 0:
        raise TraceError(f"{where}: arrival must be a finite number >= 0, got {fields[0]!r}")
    lens = []
    for name, value in (("prompt_len", fields[1]), ("output_len", fields[2])):
        n = _as_int(value)
        if n is None:
            raise TraceError(f"{where}: {name} {value!r} is not an integer")
        if n < 1:
            raise TraceError(f"{where}: {name} must be >= 1, got {n}")
        lens.append(n)
    return TraceEntry(arrival, lens[0], lens[1])


def _as_int(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def load_trace(path: str | pathlib.Path) -> list[TraceEntry]:
    p = pathlib.Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TraceError(f"cannot read trace {p}: {exc.strerror}") from None
    return parse_trace(text, str(p))


def scale_trace(entries: list[TraceEntry], speedup: float) -> list[TraceEntry]:
    """Replay a trace ``speedup`` times faster (arrival offsets divided by it)."""
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    return [TraceEntry(e.arrival / speedup, e.prompt_len, e.output_len) for e in entries]
