"""Latency predictors (xLLM §3.1/§3.2, xllm-service's TTFT and TPOT models): how long an engine
step takes, and from that a request's time to first token and time per output token.

Pure logic, no torch: the same model serves the gateway (placement against SLOs, role flips), the
engine (offline admission under a TPOT budget) and the cluster simulator (step times).

**The step model.** One engine step computes decode rows and prefill chunks together. Its time is
fitted as a linear function of five features of the step (:meth:`StepShape.features`):

    t = c0 + c1·tokens + c2·prefill_attention + c3·decode_context + c4·num_seqs

- ``tokens``: rows the step computes (every decode row and every prefill token): the GEMMs;
- ``prefill_attention``: Σ over prefill chunks of chunk·(cached + chunk/2), the causal attention
  work of the chunks (quadratic in a prompt's length);
- ``decode_context``: Σ over decode rows of the context each one attends to;
- ``num_seqs``: per-sequence costs (attention set-up, sampling, bookkeeping).

For a lone prompt of n tokens this is xllm-service's quadratic TTFT (c0 + c1·n + c2·n²/2 + c4), and
for a decode batch of b sequences with C context tokens its linear TPOT (c0 + (c1 + c4)·b + c3·C).

**Fitting** is least squares over measured steps (:class:`StepSample`), with coefficients kept
non-negative (a feature that lowers step time is a fitting artefact): :func:`fit_step_model`.
A :class:`PerfProfile` holds the samples an engine measured (``xllm profile`` writes one, JSON).

**Online correction**: :class:`OnlineCorrection` keeps an exponentially weighted mean of measured
over predicted step time for one instance, so a model fitted on one machine (or under other load)
follows what an instance actually reports.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

PROFILE_VERSION = 1
FEATURES = ("const", "tokens", "prefill_attention", "decode_context", "num_seqs")


@dataclass(frozen=True)
class StepShape:
    """What a step computes: its decode rows' contexts and its prefill chunks as (cached, chunk)."""

    decode_contexts: tuple[int, ...] = ()
    prefill_chunks: tuple[tuple[int, int], ...] = ()   # (tokens already cached, tokens computed now)

    @property
    def tokens(self) -> int:
        return len(self.decode_contexts) + sum(n for _, n in self.prefill_chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.decode_contexts) + len(self.prefill_chunks)

    def with_chunk(self, seq: ChunkSeq, n: int) -> StepShape:
        """This shape plus one more chunk of ``n`` tokens of ``seq`` (read as :func:`step_shape`
        reads it): the co-location policy sizes offline chunks against the step built so far."""
        if is_decode_row(seq, n):
            return StepShape((*self.decode_contexts, seq.num_computed_tokens + 1), self.prefill_chunks)
        return StepShape(self.decode_contexts, (*self.prefill_chunks, (seq.num_computed_tokens, n)))

    def features(self) -> tuple[float, ...]:
        """The step's features in :data:`FEATURES` order."""
        attention = sum(n * (cached + n / 2.0) for cached, n in self.prefill_chunks)
        return (1.0, float(self.tokens), attention, float(sum(self.decode_contexts)), float(self.num_seqs))


class ChunkSeq(Protocol):
    """What :func:`step_shape` reads of a sequence."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...


def is_decode_row(seq: ChunkSeq, n: int) -> bool:
    """Whether a chunk of ``n`` tokens of ``seq`` (read before the step advances it) is a decode row:
    one token at the end of a sequence that already has KV. The model runner packs these first."""
    return n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens and seq.num_computed_tokens > 0


def step_shape(chunks: Iterable[tuple[ChunkSeq, int]]) -> StepShape:
    """The shape of a step from its ``(sequence, tokens computed now)`` chunks, read *before* the step
    advances ``num_computed_tokens``: a decode row's context includes its own token; anything else is
    a prefill chunk over what is cached. The engine (what it measures), the co-location policy (what
    it predicts) and the simulator read steps through this one function."""
    decodes: list[int] = []
    prefills: list[tuple[int, int]] = []
    for seq, n in chunks:
        if is_decode_row(seq, n):
            decodes.append(seq.num_computed_tokens + 1)
        else:
            prefills.append((seq.num_computed_tokens, n))
    return StepShape(tuple(decodes), tuple(prefills))


@dataclass(frozen=True)
class StepSample:
    """One measured step: its shape and its wall time in seconds."""

    shape: StepShape
    seconds: float

    def to_dict(self) -> dict:
        return {"decode_contexts": list(self.shape.decode_contexts),
                "prefill_chunks": [list(c) for c in self.shape.prefill_chunks], "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: dict) -> StepSample:
        shape = StepShape(tuple(int(x) for x in d.get("decode_contexts", ())),
                          tuple((int(c), int(n)) for c, n in d.get("prefill_chunks", ())))
        seconds = float(d["seconds"])
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"step sample seconds must be a positive number, got {d['seconds']!r}")
        return cls(shape, seconds)


@dataclass(frozen=True)
class StepTimeModel:
    """Step seconds as a non-negative linear function of :meth:`StepShape.features`."""

    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES) or any(c < 0 or not math.isfinite(c) for c in self.coefficients):
            raise ValueError(f"a step model needs {len(FEATURES)} finite non-negative coefficients "
                             f"({', '.join(FEATURES)}), got {self.coefficients}")

    def step_seconds(self, shape: StepShape) -> float:
        if not shape.num_seqs:
            return 0.0
        return sum(c * f for c, f in zip(self.coefficients, shape.features(), strict=True))

    def decode_seconds(self, batch: int, context_tokens: int, prefill_tokens: int = 0) -> float:
        """One decode step of ``batch`` sequences attending to ``context_tokens`` in all (TPOT), with
        ``prefill_tokens`` of fresh prompt chunks riding along in the same step."""
        if batch <= 0 and prefill_tokens <= 0:
            return 0.0
        c0, c_tok, c_attn, c_ctx, c_seq = self.coefficients
        extra = c_tok * prefill_tokens + c_attn * prefill_tokens * prefill_tokens / 2.0
        extra += c_seq if prefill_tokens else 0.0
        return c0 + (c_tok + c_seq) * batch + c_ctx * context_tokens + extra

    def prefill_seconds(self, num_tokens: int, cached_tokens: int = 0, token_budget: int = 0,
                        decode_batch: int = 0, decode_context: int = 0) -> float:
        """Time to compute ``num_tokens`` prompt tokens after ``cached_tokens``, in chunks of at most
        ``token_budget`` minus the ``decode_batch`` rows every step also carries (0: one chunk)."""
        if num_tokens <= 0:
            return 0.0
        per_step = token_budget - decode_batch if token_budget > 0 else num_tokens
        per_step = max(per_step, 1)
        # each chunk's step is StepShape(decode_batch rows of decode_context // decode_batch tokens, the
        # chunk): its features summed in closed form over the chunks (routing asks this per candidate)
        c0, c_tok, c_attn, c_ctx, c_seq = self.coefficients
        rows = max(decode_batch, 0)
        context = (decode_context // rows) * rows if rows else 0
        steps = -(-num_tokens // per_step)
        attention = 0.0
        done = 0
        for _ in range(steps):
            n = min(per_step, num_tokens - done)
            attention += n * (cached_tokens + done + n / 2.0)
            done += n
        return (steps * (c0 + c_tok * rows + c_ctx * context + c_seq * (rows + 1))
                + c_tok * num_tokens + c_attn * attention)

    def queue_seconds(self, queued_tokens: int, prompt_tokens: float = 0, token_budget: int = 0,
                      decode_batch: int = 0, decode_context: int = 0) -> float:
        """Time to compute ``queued_tokens`` of queued prompts taken as fresh prompts of
        ``prompt_tokens`` each (the last one partial), in chunks as :meth:`prefill_seconds`
        (``prompt_tokens`` 0: one prompt of them all). A queue is many prompts: read as one, its
        attention term grows with the square of the whole queue (ten queued 2,048-token prompts:
        74 s of attention instead of 7.8 s with this profile's model)."""
        if queued_tokens <= 0:
            return 0.0
        size = int(prompt_tokens) if prompt_tokens >= 1 else queued_tokens
        whole, rest = divmod(queued_tokens, size)
        one = self.prefill_seconds(size, 0, token_budget, decode_batch, decode_context) if whole else 0.0
        return whole * one + self.prefill_seconds(rest, 0, token_budget, decode_batch, decode_context)

    def ttft(self, prompt_tokens: int, queued_prefill_tokens: int = 0, cached_tokens: int = 0,
             token_budget: int = 0, decode_batch: int = 0, decode_context: int = 0,
             queued_prompt_tokens: float = 0) -> float:
        """Predicted time to a new request's first token: the prefill work queued ahead of it (taken as
        fresh prompts of ``queued_prompt_tokens`` each, 0: as one prompt; :meth:`queue_seconds`), then
        its own uncached tokens, sharing steps with ``decode_batch`` decodes."""
        own = max(prompt_tokens - cached_tokens, 1)
        ahead = self.queue_seconds(queued_prefill_tokens, queued_prompt_tokens, token_budget, decode_batch,
                                   decode_context)
        return ahead + self.prefill_seconds(own, cached_tokens, token_budget, decode_batch, decode_context)

    def to_dict(self) -> dict:
        return dict(zip(FEATURES, self.coefficients, strict=True))

    @classmethod
    def from_dict(cls, d: dict) -> StepTimeModel:
        return cls(tuple(float(d[name]) for name in FEATURES))


class ReportedPredictor(Protocol):
    """An instance's step-time predictor as its load report carries it (the ``StepTimePredictor``
    message of ``xllm.proto.registry.v1``): the uncorrected coefficients (empty: no model yet) and
    the online correction factor (0 read as 1)."""

    @property
    def coefficients(self) -> Sequence[float]: ...

    @property
    def correction(self) -> float: ...


def predictor_from_report(report: ReportedPredictor) -> StepTimeModel | None:
    """The corrected step model an instance reported (None: it has none yet), for callers that predict
    step times on that instance (the gateway's router)."""
    if not report.coefficients:
        return None
    factor = report.correction if report.correction > 0 else 1.0
    return StepTimeModel(tuple(factor * c for c in report.coefficients))


def mean_model(models: Sequence[StepTimeModel]) -> StepTimeModel:
    """The coefficient-wise mean of ``models`` (not empty): the step time of an instance that has no
    model of its own yet, predicted from its peers' (instances serving one model run alike)."""
    if len(models) == 1:
        return models[0]
    return StepTimeModel(tuple(sum(c) / len(models) for c in zip(*(m.coefficients for m in models), strict=True)))


def prefill_share(model: StepTimeModel, shapes: Iterable[StepShape]) -> float:
    """The share of the time of the steps with decode rows among ``shapes`` that their prefill chunks
    take (predicted by ``model``; 0 when none has decode rows): how much a decoding request's steps are
    stretched by other requests' prompts riding along. Steps without decode rows are nobody's TPOT."""
    _, c_tok, c_attn, _, c_seq = model.coefficients
    total = riding = 0.0
    for shape in shapes:
        if not shape.decode_contexts:
            continue
        total += model.step_seconds(shape)
        riding += sum(c_tok * n + c_attn * n * (cached + n / 2.0) + c_seq for cached, n in shape.prefill_chunks)
    return riding / total if total > 0 else 0.0


def lifetime_tpot(model: StepTimeModel, batch: int, context_per_seq: float, share: float = 0.0) -> float:
    """A request's TPOT over its decode life rather than at one step: the decode step of ``batch``
    sequences of ``context_per_seq`` tokens each on average over the life (its own prompt plus half its
    output, say), stretched by the prompts that ride along meanwhile, ``share`` of the decode-carrying
    steps' time (:func:`prefill_share` of recent steps): a life of N tokens takes N·d + share·life, so
    TPOT = d / (1 − share) (share capped at 0.9). At arrival the batch is what is in the queues then;
    in a loaded engine it fills after, and prompts arrive during the life: the step at arrival
    under-predicted TPOT by 28 % on average in ``python -m benchmarks predictor``."""
    step = model.decode_seconds(max(batch, 1), int(max(batch, 1) * max(context_per_seq, 1.0)))
    return step / (1.0 - min(max(share, 0.0), 0.9))


def fit_step_model(samples: Sequence[StepSample]) -> StepTimeModel:
    """Least-squares fit of :class:`StepTimeModel` with non-negative coefficients (an active-set loop:
    a coefficient that comes out negative is fixed at zero and the rest refitted). Relative error is
    what matters for latency, so each sample is weighted by 1/seconds (its residual is relative)."""
    if len(samples) < 2:
        raise ValueError(f"fitting a step model needs at least 2 measured steps, got {len(samples)}")
    rows = [s.shape.features() for s in samples]
    weights = [1.0 / s.seconds for s in samples]
    active = list(range(len(FEATURES)))
    while True:
        coef = _least_squares([[r[j] for j in active] for r in rows], [s.seconds for s in samples], weights)
        negative = [j for j, c in zip(active, coef, strict=True) if c < 0]
        if not negative:
            full = [0.0] * len(FEATURES)
            for j, c in zip(active, coef, strict=True):
                full[j] = c
            return StepTimeModel(tuple(full))
        worst = min(negative, key=lambda j: coef[active.index(j)])
        active.remove(worst)
        if not active:
            return StepTimeModel((sum(s.seconds for s in samples) / len(samples), 0.0, 0.0, 0.0, 0.0))


def _least_squares(x: list[list[float]], y: list[float], w: list[float]) -> list[float]:
    """Weighted least squares by the normal equations, columns scaled to unit size first and a tiny
    ridge added so a feature that never varies (e.g. no prefill in the data) gets 0, not a blow-up."""
    k = len(x[0])
    scale = [max(max(abs(r[j]) for r in x), 1e-12) for j in range(k)]
    xs = [[r[j] / scale[j] for j in range(k)] for r in x]
    ata = [[sum(wi * wi * r[i] * r[j] for r, wi in zip(xs, w, strict=True)) for j in range(k)] for i in range(k)]
    atb = [sum(wi * wi * r[i] * yi for r, yi, wi in zip(xs, y, w, strict=True)) for i in range(k)]
    ridge = 1e-9 * max(ata[i][i] for i in range(k))
    for i in range(k):
        ata[i][i] += ridge
    sol = _solve(ata, atb)
    return [s / scale[j] for j, s in enumerate(sol)]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (k is at most 5)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [vr - f * vc for vr, vc in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] if abs(m[i][i]) > 1e-300 else 0.0 for i in range(n)]


def relative_errors(model: StepTimeModel, samples: Iterable[StepSample]) -> list[float]:
    """|predicted − measured| / measured per sample (the held-out error of a fitted model)."""
    return [abs(model.step_seconds(s.shape) - s.seconds) / s.seconds for s in samples]


@dataclass
class PerfProfile:
    """Measured steps of one engine configuration (model, dtype, threads, machine) and the model fitted
    to them. ``xllm profile`` writes one; the engine (``--profile FILE``), the gateway and the
    simulator read it."""

    model: str
    dtype: str
    threads: int
    machine: str
    token_budget: int
    samples: list[StepSample] = field(default_factory=list)
    created: float = 0.0
    version: int = PROFILE_VERSION
    # the format of the quantized weights the engine served ("" float weights; None: not recorded, a
    # profile from before the field): a Q4_1 model's decode steps take ~0.6x a bf16 one's
    weights: str | None = None

    def fit(self) -> StepTimeModel:
        return fit_step_model(self.samples)

    def mismatches(self, dtype: str, weights: str, threads: int) -> list[str]:
        """How an engine of ``dtype``, quantized ``weights`` ("" float) and ``threads`` differs from the one
        this profile measured (empty: alike, or not recorded). Its step model then mispredicts by shape,
        which one online correction factor cannot undo: bf16 engines predicted from a Q4_1 profile ran
        decode steps 1.7x and prefill chunks 1.3x their predictions."""
        out = []
        if dtype != self.dtype:
            out.append(f"dtype {dtype} (profile: {self.dtype})")
        if self.weights is not None and weights != self.weights:
            out.append(f"weights {weights or 'float'} (profile: {self.weights or 'float'})")
        if threads != self.threads:
            out.append(f"threads {threads} (profile: {self.threads})")
        return out

    def to_json(self) -> str:
        d = asdict(self)
        d["samples"] = [s.to_dict() for s in self.samples]
        d["model_fit"] = self.fit().to_dict() if len(self.samples) >= 2 else None
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> PerfProfile:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError(f"a profile is a JSON object, got {type(d).__name__}")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"unsupported profile version {d.get('version')!r} (this build reads {PROFILE_VERSION})")
        return cls(model=str(d["model"]), dtype=str(d["dtype"]), threads=int(d["threads"]),
                   machine=str(d["machine"]), token_budget=int(d["token_budget"]),
                   samples=[StepSample.from_dict(s) for s in d["samples"]], created=float(d.get("created", 0.0)),
                   weights=None if d.get("weights") is None else str(d["weights"]))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> PerfProfile:
        return cls.from_json(Path(path).read_text())


class OnlineCorrection:
    """Measured over predicted step time, as an exponentially weighted mean (weight ``alpha`` for the
    newest step), so predictions follow what one instance actually reports. Starts at 1."""

    def __init__(self, model: StepTimeModel, alpha: float = 0.1, clamp: tuple[float, float] = (0.2, 5.0)) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.model, self.alpha, self.clamp = model, alpha, clamp
        self.factor = 1.0
        self.observations = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        predicted = self.model.step_seconds(shape)
        if predicted <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        ratio = min(max(seconds / predicted, self.clamp[0]), self.clamp[1])
        self.factor += self.alpha * (ratio - self.factor)
        self.observations += 1

    def step_seconds(self, shape: StepShape) -> float:
        return self.factor * self.model.step_seconds(shape)
