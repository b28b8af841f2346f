"""``xllm profile``: measure how long the real engine's steps take, by shape, and write a
:class:`xllm.sched.latency.PerfProfile` (the latency predictors' training data, xLLM §3.1).

The engine is the one ``xllm serve`` runs (same flags, same fused native steps); the profiler only
feeds it requests so that its own scheduler forms the steps of a grid (:class:`ProfileGrid`), and
reads every step's shape and time from the engine's step-time predictor
(:class:`xllm.core.step_timing.StepTiming`'s listeners), so a profile measures exactly what a serving
engine measures about itself (see that module for what a step's time is). Three kinds of step:

- **decode ladders**: at each context length ``c`` of ``decode_contexts``, sequences with ``c``-token
  prompts are added until the running batch is each size of ``batches`` in turn (sizes whose context
  would exceed ``ladder_tokens`` tokens in all are skipped, so long contexts stop at smaller
  batches); at each size, pure decode steps of that batch;
- **mixed steps**: at each ladder size, the decodes plus a fresh prompt chunk of each size of
  ``mixed_chunks`` (a probe request of that many tokens and one output token);
- **prefill chunks**: alone in a step, a chunk of each size of ``prefill_chunks`` after each length
  of ``prefill_cached`` already cached (a common prefix computed once, then reused from the prefix
  cache by every probe; without the prefix cache only uncached chunks are measured).

Each grid point runs ``warmup`` unmeasured steps and ``reps`` measured ones; the profile keeps, per
point, the median time with the shape of the middle repetition (decode contexts grow by one token a
step). Setting up a point (prefilling a ladder's new sequences, computing a prefix) is not measured.
The engine always runs synchronously here: with ``--async-scheduling`` an engine measures the forward
alone, which its online correction absorbs.
"""

from __future__ import annotations

import logging
import os
import pathlib
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from xllm.core import LLMEngine
from xllm.models.quantize import weight_format
from xllm.proto.engine.v1 import engine_pb2
from xllm.sched.latency import PerfProfile, StepSample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileGrid:
    """The step shapes ``xllm profile`` measures (see the module docstring). ``batches`` of ``None``:
    powers of two up to the engine's ``max_num_seqs``, and ``max_num_seqs`` itself."""

    decode_contexts: tuple[int, ...] = (128, 512, 1536)
    batches: tuple[int, ...] | None = None
    ladder_tokens: int = 8192
    mixed_chunks: tuple[int, ...] = (64, 256)
    prefill_chunks: tuple[int, ...] = (32, 128, 512)
    prefill_cached: tuple[int, ...] = (0, 1024, 3072)
    reps: int = 3
    warmup: int = 1

    def __post_init__(self) -> None:
        for name in ("decode_contexts", "mixed_chunks", "prefill_chunks", "batches"):
            values = getattr(self, name)
            if values is not None and any(v < 1 for v in values):
                raise ValueError(f"{name}: every value must be >= 1, got {values}")
        if any(v < 0 for v in self.prefill_cached):
            raise ValueError(f"prefill_cached: every value must be >= 0, got {self.prefill_cached}")
        if self.reps < 1 or self.warmup < 0 or self.ladder_tokens < 1:
            raise ValueError("reps and ladder_tokens must be >= 1, warmup >= 0")


# A grid for tests and smoke runs: small contexts and chunks, two repetitions.
QUICK_GRID = ProfileGrid(decode_contexts=(32, 96), batches=(1, 2, 4), ladder_tokens=512, mixed_chunks=(16,),
                         prefill_chunks=(8, 48), prefill_cached=(0, 64), reps=2, warmup=1)


@dataclass(frozen=True)
class GridPoint:
    """One measured point: its kind (``decode``, ``mixed``, ``prefill``) and parameters."""

    kind: str
    batch: int = 0        # decodes in the step
    context: int = 0      # prompt length of the ladder's sequences
    chunk: int = 0        # prefill tokens computed in the step
    cached: int = 0       # prefix meant to be cached before the chunk


@dataclass
class ProfileRun:
    """What :func:`run_profile` measured: per grid point the repetitions' samples and the kept one."""

    points: list[GridPoint] = field(default_factory=list)
    repetitions: list[list[StepSample]] = field(default_factory=list)
    samples: list[StepSample] = field(default_factory=list)
    seconds: float = 0.0


class _Driver:
    """Feeds one engine the requests of the grid and collects the steps its StepTiming observes."""

    def __init__(self, engine: LLMEngine, seed: int) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.vocab = int(engine.model.vocab_size)
        self.observed: list[StepSample] = []
        self.n = 0
        engine.add_step_listener(self.observed.append)

    def close(self) -> None:
        self.engine.remove_step_listener(self.observed.append)

    def tokens(self, n: int) -> list[int]:
        lo = min(100, self.vocab // 2)
        return [self.rng.randrange(lo, self.vocab) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        self.n += 1
        rid = f"profile-{self.n}"
        self.engine.add_request(engine_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt,
            sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
        return rid

    def step(self) -> StepSample | None:
        """One engine step; the sample it observed (None: nothing ran)."""
        before = len(self.observed)
        self.engine.step()
        return self.observed[-1] if len(self.observed) > before else None

    def drain(self) -> StepSample | None:
        """Step until the engine is idle; the last step's sample."""
        last = None
        while self.engine.has_work():
            last = self.step() or last
        return last

    def settle(self) -> None:
        """Step until nothing waits and every running sequence decodes (one token per step)."""
        while not self.engine.all_decoding():
            self.engine.step()

    def abort_all(self) -> None:
        for request_id in self.engine.unfinished_request_ids():
            self.engine.abort(request_id)
        self.drain()


def plan_grid(grid: ProfileGrid, engine: LLMEngine) -> list[GridPoint]:
    """The grid points that fit ``engine`` (its sequences, token budget, context length, KV room),
    in the order they are measured (prefill points first, then each ladder with its mixed steps)."""
    cfg = engine.config
    budget, max_seqs, max_len = cfg.max_num_batched_tokens, cfg.max_num_seqs, engine.max_model_len
    room = engine.layout.capacity_tokens
    steps = grid.warmup + grid.reps
    points: list[GridPoint] = []
    cached_levels = sorted(set(grid.prefill_cached))
    if not engine.layout.enable_prefix_cache:
        skipped = [k for k in cached_levels if k > 0]
        if skipped:
            log.warning("xllm profile: no prefix cache, so no prefill chunks after cached tokens (%s skipped)",
                        skipped)
        cached_levels = [0]
    for k in cached_levels:
        for n in sorted(set(grid.prefill_chunks)):
            if n <= budget and k + n + 1 <= max_len and k + n + 1 <= room:
                points.append(GridPoint("prefill", chunk=n, cached=k))
    batches = grid.batches or tuple(sorted({*(1 << i for i in range(max_seqs.bit_length())), max_seqs}))
    for c in sorted(set(grid.decode_contexts)):
        ladder_steps = steps * (1 + len(grid.mixed_chunks))  # decodes grow by one token per step
        for b in sorted({b for b in batches if b <= max_seqs}):
            if b > 1 and b * c > grid.ladder_tokens:
                break
            if c + ladder_steps * len(batches) + 1 > max_len or b * (c + ladder_steps * len(batches)) > room:
                break
            points.append(GridPoint("decode", batch=b, context=c))
            for n in sorted(set(grid.mixed_chunks)):
                if b < max_seqs and b + n <= budget and b * (c + ladder_steps * len(batches)) + n + 1 <= room:
                    points.append(GridPoint("mixed", batch=b, context=c, chunk=n))
    return points


def run_profile(engine: LLMEngine, grid: ProfileGrid, seed: int = 0,
                on_point: Callable[[GridPoint], None] | None = None) -> ProfileRun:
    """Measure ``grid`` on ``engine`` (idle, synchronous scheduling; run on its compute thread) and
    return the samples; ``on_point`` hears each point measured (a progress bar)."""
    if engine.config.async_scheduling:
        raise ValueError("xllm profile measures the synchronous engine (drop --async-scheduling)")
    if engine.has_work():
        raise ValueError("the engine to profile must be idle")
    points = plan_grid(grid, engine)
    run = ProfileRun()
    d = _Driver(engine, seed)
    t0 = time.perf_counter()
    try:
        _warm_up(d)
        prefixes: dict[int, list[int]] = {}
        ladder: tuple[int, int] | None = None   # (context, sequences running) of the ladder in progress
        for point in points:
            if point.kind == "prefill":
                if ladder is not None:
                    d.abort_all()
                    ladder = None
                reps = [_prefill_probe(d, point, prefixes) for _ in range(grid.warmup + grid.reps)]
            else:
                if ladder is None or ladder[0] != point.context:
                    d.abort_all()
                    ladder = (point.context, 0)
                running = ladder[1]
                for _ in range(point.batch - running):
                    d.add(d.tokens(point.context), max_tokens=engine.max_model_len - point.context)
                d.settle()
                ladder = (point.context, point.batch)
                if point.kind == "decode":
                    reps = [d.step() for _ in range(grid.warmup + grid.reps)]
                else:
                    reps = [_mixed_probe(d, point) for _ in range(grid.warmup + grid.reps)]
            measured = [s for s in reps[grid.warmup:] if s is not None]
            if measured:
                run.points.append(point)
                run.repetitions.append(measured)
                middle = measured[len(measured) // 2]
                run.samples.append(StepSample(middle.shape, statistics.median(s.seconds for s in measured)))
            if on_point is not None:
                on_point(point)
        d.abort_all()
    finally:
        d.close()
    run.seconds = time.perf_counter() - t0
    return run


def _warm_up(d: _Driver) -> None:
    """First steps pay for weight packing, kernel choices and first-touch memory: run a budget-sized
    prefill and a few decode steps unmeasured."""
    budget = d.engine.config.max_num_batched_tokens
    n = max(1, min(budget, d.engine.max_model_len - 8, d.engine.layout.capacity_tokens - 8))
    d.add(d.tokens(n), max_tokens=4)
    d.add(d.tokens(min(n, 16)), max_tokens=4)
    d.drain()


def _prefill_probe(d: _Driver, point: GridPoint, prefixes: dict[int, list[int]]) -> StepSample | None:
    """A prompt of the cached prefix plus ``chunk`` fresh tokens, alone, one output token: the step
    that computes its last chunk."""
    prefix = prefixes.get(point.cached)
    if prefix is None:
        prefix = prefixes[point.cached] = d.tokens(point.cached)
        if prefix:
            d.add(prefix + d.tokens(1), max_tokens=1)  # computes the prefix into the prefix cache
            d.drain()
    d.add(prefix + d.tokens(point.chunk), max_tokens=1)
    return d.drain()


def _mixed_probe(d: _Driver, point: GridPoint) -> StepSample | None:
    """The ladder's decodes plus a fresh ``chunk``-token prompt that ends with its first token."""
    d.add(d.tokens(point.chunk), max_tokens=1)
    sample = d.step()
    d.settle()  # in case the probe did not fit in one step
    return sample


def machine_name() -> str:
    """CPU model and core count, for the profile's ``machine`` field."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


def make_profile(engine: LLMEngine, run: ProfileRun, model_name: str, threads: int) -> PerfProfile:
    """The :class:`PerfProfile` of a run on ``engine``."""
    return PerfProfile(model=model_name, dtype=str(engine.config.dtype).removeprefix("torch."), threads=threads,
                       machine=machine_name(), token_budget=engine.config.max_num_batched_tokens,
                       samples=list(run.samples), created=time.time(), weights=weight_format(engine.model) or "")


def grid_from_args(args) -> ProfileGrid:
    """The grid the ``xllm profile`` flags describe (``--quick`` as the base, flags override)."""
    base = QUICK_GRID if args.quick else ProfileGrid()
    given = {"decode_contexts": args.decode_contexts, "batches": args.batches, "ladder_tokens": args.ladder_tokens,
             "mixed_chunks": args.mixed_chunks, "prefill_chunks": args.prefill_chunks,
             "prefill_cached": args.prefill_cached, "reps": args.reps, "warmup": args.warmup}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None}
    return ProfileGrid(**{**base.__dict__, **given})


def default_output(model_name: str, dtype: str, threads: int, weights: str | None = None) -> pathlib.Path:
    """``MODEL-DTYPE-tTHREADS.json`` under the cache's ``profiles/``; with quantized ``weights`` (their format,
    e.g. ``q4_1``) ``MODEL-DTYPE-WEIGHTS-tTHREADS.json``: a quantized model's steps are another profile."""
    from xllm.common.paths import cache_dir

    fmt = f"-{weights}" if weights else ""
    return cache_dir("profiles", f"{pathlib.Path(model_name).name}-{dtype}{fmt}-t{threads}.json")


def command(args) -> int:
    """``xllm profile``: load the model like ``xllm serve``, measure the grid, write the profile."""
    import sys

    from tqdm.auto import tqdm

    from xllm.engine.config import engine_config
    from xllm.engine.loader import load_engine
    from xllm.engine_api.errors import ConfigError
    from xllm.models import ModelConfigError, ModelNotFoundError, served_name
    from xllm.sched.latency import relative_errors

    try:
        grid = grid_from_args(args)
        cfg = engine_config(args)
        if cfg.async_scheduling:
            log.info("xllm profile runs the engine synchronously (--async-scheduling ignored)")
            cfg.async_scheduling = False
        name = served_name(args.model, args.served_model_name)
        loaded = load_engine(args.model, name, cfg, "profile", not args.no_progress)
    except (ConfigError, ModelNotFoundError, ModelConfigError, ValueError, OSError) as exc:
        print(f"xllm profile: error: {exc}", file=sys.stderr)
        return 2
    engine = loaded.engine
    threads = loaded.compute.call(lambda: __import__("torch").get_num_threads())
    dtype = str(cfg.dtype).removeprefix("torch.")
    output = args.output or default_output(name, dtype, threads, weight_format(engine.model))
    points = loaded.compute.call(plan_grid, grid, engine)
    with tqdm(total=len(points), desc="profiling steps", unit="shape", disable=args.no_progress) as bar:
        run = loaded.compute.call(run_profile, engine, grid, cfg.seed, lambda _p: bar.update())
    loaded.compute.call(engine.close)
    loaded.compute.shutdown()
    profile = make_profile(engine, run, name, threads)
    if len(profile.samples) < 2:
        print(f"xllm profile: error: only {len(profile.samples)} grid points fit this engine; widen the grid",
              file=sys.stderr)
        return 2
    path = pathlib.Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    model = profile.fit()
    errs = sorted(relative_errors(model, profile.samples))
    coef = ", ".join(f"{k}={v:.3g}" for k, v in model.to_dict().items())
    print(f"wrote {path}: {len(profile.samples)} step shapes in {run.seconds:.0f} s; fit {coef}; "
          f"relative error on its own samples p50 {errs[len(errs) // 2]:.1%}, max {errs[-1]:.1%}")
    return 0
