"""What the simulated clients send: one :class:`RequestSpec` per request, from a synthetic arrival
process (Poisson, Gamma) or a trace file.

- Arrivals: ``poisson`` (exponential gaps of mean ``1/rate``) or ``gamma`` (Gamma gaps of mean
  ``1/rate`` and coefficient of variation ``cv``: ``cv > 1`` is bursty).
- Phases (``phases``): Gamma arrivals as above, but the length mix shifts over time, as in the
  bursty traces of xLLM §3.2 where the prefill/decode balance of the load changes: periods of
  ``phase_s[0]`` seconds of prefill-heavy requests (``prefill_mix``: long prompts, short outputs)
  alternate with ``phase_s[1]`` seconds of decode-heavy ones (``decode_mix``: short prompts, long
  outputs), starting prefill-heavy; a request's mix is that of the phase it arrives in
  (:meth:`Workload.phase_of`). ``prompt``/``output`` are not used then.
- Lengths: a spec string, ``"N"`` (fixed), ``"uniform:LO:HI"`` (inclusive) or
  ``"lognormal:MEAN:SIGMA[:MAX]"`` (mean in tokens, sigma of the underlying normal, clipped to
  [1, MAX], MAX 8·MEAN by default) — the syntax of ``benchmarks/workload.py``.
- Shared prefixes: with ``prefix_groups`` G > 0 every request's first ``prefix_len`` tokens (at most
  its prompt minus one) are the system prompt of one of G groups (Zipf-like popularity ``1/(g+1)``),
  so prefix-cache hits and KV-aware routing have something to find.
- Offline: a fraction ``offline_fraction`` of the requests is offline (``service_tier: flex``).
- Images: a fraction ``image_fraction`` of the requests carries ``images_per_request`` images each (their image
  tokens are part of the prompt length); the instances run their encode phase (:mod:`xllm.sched.encode`).
- Trace files: the public Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``,
  timestamps as ``2023-11-16 18:15:46.6805900`` or seconds), or ``arrival,prompt_len,output_len`` in
  seconds (the benchmarks' format). Arrivals are re-based to start at 0; a malformed row raises
  :class:`TraceError` naming the file and line. A row with 0 generated tokens is simulated as 1 (the
  engine samples at least one token).
"""

from __future__ import annotations

import csv
import datetime
import io
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class TraceError(ValueError):
    """A trace or length spec that cannot be used; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One simulated request. ``prefix_group`` -1: no shared prefix."""

    rid: int
    arrival: float            # seconds from the start of the run
    prompt_len: int
    output_len: int
    prefix_group: int = -1
    prefix_len: int = 0       # leading prompt tokens shared with every request of the group
    offline: bool = False
    images: int = 0           # images to encode before its prefill (their tokens are in prompt_len)


# ---- lengths ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts (see the module docstring for the spec syntax)."""

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        text = str(spec).strip()
        parts = text.split(":")
        try:
            if len(parts) == 1:
                n = int(parts[0])
                if n >= 1:
                    return cls("fixed", (n,))
                raise TraceError(f"bad length spec {text!r}: a fixed length must be >= 1")
            kind, nums = parts[0].lower(), [float(p) for p in parts[1:]]
        except ValueError as exc:
            if isinstance(exc, TraceError):
                raise
            raise TraceError(f"bad length spec {text!r}: expected N, uniform:LO:HI or lognormal:MEAN:SIGMA[:MAX]") \
                from None
        if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
            return cls(kind, (int(nums[0]), int(nums[1])))
        if kind == "lognormal" and len(nums) in (2, 3) and nums[0] >= 1 and nums[1] >= 0:
            return cls(kind, (nums[0], nums[1], nums[2] if len(nums) == 3 else 8 * nums[0]))
        raise TraceError(f"bad length spec {text!r}: expected N, uniform:LO:HI (1 <= LO <= HI) "
                         "or lognormal:MEAN:SIGMA[:MAX]")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.params[0])
        if self.kind == "uniform":
            return rng.randint(int(self.params[0]), int(self.params[1]))
        mean_tokens, sigma, cap = self.params
        mu = math.log(mean_tokens) - sigma * sigma / 2  # so that E[X] = mean_tokens
        return int(min(cap, max(1, round(rng.lognormvariate(mu, sigma)))))


# ---- synthetic traces -------------------------------------------------------------------------------

ARRIVALS = ("poisson", "gamma", "phases")
PREFILL_HEAVY = ("lognormal:2048:0.3:4096", "lognormal:32:0.5:128")
"""The ``phases`` workload's default prefill-heavy mix (prompt spec, output spec)."""
DECODE_HEAVY = ("lognormal:128:0.5:512", "lognormal:512:0.3:1024")
"""The ``phases`` workload's default decode-heavy mix (prompt spec, output spec)."""


@dataclass(frozen=True)
class Workload:
    """How synthetic requests look; ``arrivals`` is one of :data:`ARRIVALS` (``phases``: Gamma
    arrivals of CV ``cv`` and alternating length mixes, see the module docstring)."""

    arrivals: str = "poisson"
    rate: float = 1.0
    cv: float = 1.0
    prompt: str = "lognormal:512:0.6:2048"
    output: str = "lognormal:128:0.6:512"
    prefix_groups: int = 0
    prefix_len: int = 0
    offline_fraction: float = 0.0
    image_fraction: float = 0.0
    images_per_request: int = 1
    phase_s: tuple[float, float] = (60.0, 60.0)     # phases: prefill-heavy seconds, decode-heavy seconds
    prefill_mix: tuple[str, str] = PREFILL_HEAVY     # phases: (prompt spec, output spec) of prefill-heavy
    decode_mix: tuple[str, str] = DECODE_HEAVY       # phases: (prompt spec, output spec) of decode-heavy

    def check(self) -> None:
        """Raise :class:`TraceError` naming the first bad setting (length specs included)."""
        if self.arrivals not in ARRIVALS:
            raise TraceError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        if not self.rate > 0 or not self.cv > 0:
            raise TraceError(f"rate and cv must be > 0, got rate={self.rate} cv={self.cv}")
        if self.prefix_groups < 0 or self.prefix_len < 0 or not 0 <= self.offline_fraction <= 1:
            raise TraceError("prefix_groups, prefix_len >= 0 and 0 <= offline_fraction <= 1 are required")
        if not 0 <= self.image_fraction <= 1 or self.images_per_request < 1:
            raise TraceError(f"0 <= image_fraction <= 1 and images_per_request >= 1 are required, got "
                             f"{self.image_fraction} and {self.images_per_request}")
        if self.arrivals == "phases":
            if len(self.phase_s) != 2 or not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0
                                                 for x in self.phase_s):
                raise TraceError(f"phase_s must be two durations > 0 (prefill-heavy, decode-heavy seconds), "
                                 f"got {self.phase_s!r}")
            for name, mix in (("prefill_mix", self.prefill_mix), ("decode_mix", self.decode_mix)):
                if len(mix) != 2:
                    raise TraceError(f"{name} must be (prompt spec, output spec), got {mix!r}")
        self.mixes()  # the length specs parse

    def mixes(self) -> list[tuple[LengthDist, LengthDist]]:
        """The (prompt, output) distributions of each phase: one for poisson/gamma, [prefill-heavy,
        decode-heavy] for ``phases``."""
        specs = [self.prefill_mix, self.decode_mix] if self.arrivals == "phases" else [(self.prompt, self.output)]
        return [(LengthDist.parse(p), LengthDist.parse(o)) for p, o in specs]

    def phase_of(self, t: float) -> int:
        """The phase of arrival time ``t``: 0 (prefill-heavy, or the only one) or 1 (decode-heavy)."""
        if self.arrivals != "phases":
            return 0
        pf, dec = self.phase_s
        return 0 if math.fmod(t, pf + dec) < pf else 1


def synthetic(workload: Workload, n: int, seed: int = 0) -> Iterator[RequestSpec]:
    """``n`` requests of ``workload``, generated lazily (one random stream per aspect, so changing
    the lengths does not move the arrivals)."""
    workload.check()
    mixes = workload.mixes()
    r_arr, r_len, r_pre, r_off, r_img = (random.Random(f"{seed}:{k}")
                                         for k in ("arrival", "length", "prefix", "offline", "images"))
    shape = 1.0 / (workload.cv * workload.cv)
    scale = 1.0 / (workload.rate * shape)
    weights = [1.0 / (g + 1) for g in range(workload.prefix_groups)]
    poisson = workload.arrivals == "poisson"
    t = 0.0
    for rid in range(n):
        t += r_arr.expovariate(workload.rate) if poisson else r_arr.gammavariate(shape, scale)
        prompt, output = mixes[workload.phase_of(t)]
        p, o = prompt.draw(r_len), output.draw(r_len)
        yield _decorate(RequestSpec(rid, t, p, o), workload, weights, r_pre, r_off, r_img)


def _decorate(spec: RequestSpec, workload: Workload, weights: list[float], r_pre: random.Random,
              r_off: random.Random, r_img: random.Random) -> RequestSpec:
    group, plen = -1, 0
    if weights and workload.prefix_len > 0:
        group = r_pre.choices(range(len(weights)), weights)[0]
        plen = min(workload.prefix_len, spec.prompt_len - 1)
    offline = workload.offline_fraction > 0 and r_off.random() < workload.offline_fraction
    images = workload.images_per_request if workload.image_fraction > 0 and r_img.random() < workload.image_fraction \
        else 0
    return RequestSpec(spec.rid, spec.arrival, spec.prompt_len, spec.output_len, group, plen, offline, images)


def decorate(specs: list[RequestSpec], workload: Workload, seed: int = 0) -> list[RequestSpec]:
    """Give trace requests shared prefixes, offline flags and images as ``workload`` says (lengths and
    arrivals kept)."""
    weights = [1.0 / (g + 1) for g in range(workload.prefix_groups)]
    r_pre, r_off, r_img = (random.Random(f"{seed}:{k}") for k in ("prefix", "offline", "images"))
    return [_decorate(s, workload, weights, r_pre, r_off, r_img) for s in specs]


# ---- trace files ----------------------------------------------------------------------------------------

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def parse_trace(text: str, source: str = "<trace>", limit: int | None = None) -> list[RequestSpec]:
    """Requests of a trace CSV: Azure's (header ``TIMESTAMP,ContextTokens,GeneratedTokens``) or
    ``arrival,prompt_len,output_len`` (optional header, ``#`` comments). Sorted by arrival (Azure's
    files are), re-based to start at 0, at most ``limit`` of them."""
    rows = csv.reader(io.StringIO(text))
    out: list[tuple[float, int, int]] = []
    columns: tuple[int, int, int] | None = None
    for lineno, row in enumerate(rows, 1):
        fields = [f.strip() for f in row]
        if not fields or not any(fields) or fields[0].startswith("#"):
            continue
        where = f"{source}:{lineno}"
        if columns is None and not out and not _is_number(fields[0]) and not _is_timestamp(fields[0]):
            columns = _header(fields, where)
            continue
        idx = columns or (0, 1, 2)
        if len(fields) <= max(idx):
            raise TraceError(f"{where}: expected {max(idx) + 1} fields, got {len(fields)}")
        arrival = _arrival(fields[idx[0]], where)
        prompt = _tokens(fields[idx[1]], "prompt tokens", where, minimum=1)
        output = max(_tokens(fields[idx[2]], "output tokens", where, minimum=0), 1)  # a 0 still samples one token
        if out and arrival < out[-1][0]:
            raise TraceError(f"{where}: arrival {fields[idx[0]]} is before the previous row's; sort the trace")
        out.append((arrival, prompt, output))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise TraceError(f"{source}: no requests in the trace")
    t0 = out[0][0]
    return [RequestSpec(i, a - t0, p, o) for i, (a, p, o) in enumerate(out)]


def load_trace(path: str | Path, limit: int | None = None) -> list[RequestSpec]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TraceError(f"cannot read trace {p}: {exc.strerror}") from None
    return parse_trace(text, str(p), limit)


def _header(fields: list[str], where: str) -> tuple[int, int, int]:
    lower = [f.lower() for f in fields]
    for names in (AZURE_COLUMNS, ("arrival", "prompt_len", "output_len")):
        try:
            return tuple(lower.index(n.lower()) for n in names)  # type: ignore[return-value]
        except ValueError:
            continue
    raise TraceError(f"{where}: unknown header {','.join(fields)!r}; expected {','.join(AZURE_COLUMNS)} "
                     "(the Azure LLM inference trace) or arrival,prompt_len,output_len")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_timestamp(text: str) -> bool:
    return _parse_timestamp(text) is not None


def _parse_timestamp(text: str) -> float | None:
    """Seconds since the epoch of an Azure trace timestamp (``2023-11-16 18:15:46.6805900``: more
    fractional digits than ``datetime`` takes, so they are cut to microseconds)."""
    date, _, frac = text.partition(".")
    try:
        base = datetime.datetime.fromisoformat(date.strip()).replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        return None
    digits = frac.strip()
    if digits and not digits.isdigit():
        return None
    return base.timestamp() + (int(digits[:6].ljust(6, "0")) / 1e6 if digits else 0.0)


def _arrival(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = _parse_timestamp(text)
        if value is None:
            raise TraceError(f"{where}: timestamp {text!r} is neither seconds nor YYYY-MM-DD HH:MM:SS[.frac]") \
                from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}: arrival must be a finite number >= 0, got {text!r}")
    return value


def _tokens(text: str, name: str, where: str, minimum: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise TraceError(f"{where}: {name} {text!r} is not an integer") from None
    if n < minimum:
        raise TraceError(f"{where}: {name} must be >= {minimum}, got {n}")
    return n
