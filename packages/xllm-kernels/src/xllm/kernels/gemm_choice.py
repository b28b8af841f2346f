"""Per-shape choice between the native packed GEMM and oneDNN for more rows than the skinny GEMV takes.

Which kernel is faster depends on the weight shape, the dtype and the row count M, and on the machine,
so it is measured, not guessed: the first time a shape ``[N, K]`` needs a large-batch GEMM,
:func:`choose` times both candidates (``xllm.kernels.gemm.packed_linear`` against oneDNN's
``_linear_pointwise`` on a ``_reorder_linear_weight`` copy) at the M buckets 16, 32, ..., 2048 with
interleaved repetitions (alternating which runs first), and keeps the per-bucket winner by the ratio
of the two candidates' lower-quartile times (contention on a shared machine only adds time, often to
most repetitions, so neither the mean nor the median is robust). Results persist as JSON in
``$XLLM_CACHE_DIR/kernels/gemm-choice-<key>.json``, the key covering the CPU model and flags, the
thread count, torch's version and the native library build (its sources), so each shape is measured
once per machine and kernel version.

Cost: a bucket gets 5..25 interleaved repetitions within ~20 ms of GEMMs; buckets stop early once a
shape has spent ~0.4 s (the larger M buckets then inherit the last measured winner). For SmolLM2-135M
bf16 (four layer shapes plus the 49152-row LM head) that is ~1-2 s once per machine, then a JSON read.

``XLLM_GEMM=native`` or ``XLLM_GEMM=onednn`` forces one kernel for every shape (benchmarks, debugging).
"""

from __future__ import annotations

import bisect
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from xllm.common import cache_dir
from xllm.kernels import gemm, native

log = logging.getLogger(__name__)

BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
_BUCKET_BUDGET_S = 0.02
_SHAPE_BUDGET_S = 0.4
_MIN_REPS, _MAX_REPS = 5, 25
FORCE_ENV = "XLLM_GEMM"


@dataclass(frozen=True)
class GemmChoice:
    """Per M bucket, whether the native packed GEMM measured faster than oneDNN for one shape.

    ``ratios[i]`` is the native/oneDNN ratio of lower-quartile times at ``buckets[i]`` (None when the bucket was
    not measured and inherits the previous bucket's winner)."""

    buckets: tuple[int, ...]
    native_faster: tuple[bool, ...]
    ratios: tuple[float | None, ...] = ()

    def use_native(self, m: int, slack: float = 1.0) -> bool:
        """Whether ``m`` rows should take the native kernel (the first bucket >= m, else the last). ``slack``
        > 1 credits the native kernel with work the other route adds after the product (its measured
        native/oneDNN ratio need only be below ``slack``; an unmeasured bucket keeps its winner)."""
        i = min(bisect.bisect_left(self.buckets, m), len(self.buckets) - 1)
        ratio = self.ratios[i] if i < len(self.ratios) else None
        return self.native_faster[i] or (slack > 1.0 and ratio is not None and ratio < slack)

    @property
    def any_native(self) -> bool:
        return any(self.native_faster)

    @property
    def any_onednn(self) -> bool:
        return not all(self.native_faster)


def forced(value: bool) -> GemmChoice:
    return GemmChoice(BUCKETS, (value,) * len(BUCKETS))


def _low_quartile(values: list[float]) -> float:
    """The 25th percentile: on a shared machine the noise (a team thread preempted at a barrier) only
    ever adds time, often to most of the repetitions, so the lower quartile is the robust estimate."""
    return statistics.quantiles(values, n=4, method="inclusive")[0] if len(values) > 1 else values[0]


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _cache_file() -> pathlib.Path:
    lib = native.library()
    cpu, flags = platform.processor() or "?", ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = " ".join(sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx"))))
                break
    except OSError:
        pass
    key = hashlib.sha256(f"{cpu}|{flags}|{torch.get_num_threads()}|{torch.__version__}|{lib.path.parent.name}"
                         .encode()).hexdigest()[:16]
    return cache_dir("kernels") / f"gemm-choice-{key}.json"


def _shape_key(n: int, k: int, dtype: torch.dtype) -> str:
    return f"{'bf16' if dtype == torch.bfloat16 else 'f32'}:{n}x{k}"


def measure(weight: torch.Tensor, buckets: tuple[int, ...] | None = None, shape_budget_s: float | None = None,
            bucket_budget_s: float | None = None) -> GemmChoice | None:
    """Time the native packed GEMM against oneDNN for ``weight`` at each bucket (default
    :data:`BUCKETS`; no caching); None when either candidate is unavailable for this weight."""
    buckets = BUCKETS if buckets is None else buckets
    shape_budget_s = _SHAPE_BUDGET_S if shape_budget_s is None else shape_budget_s
    bucket_budget_s = _BUCKET_BUDGET_S if bucket_budget_s is None else bucket_budget_s
    pw = gemm.pack(weight)
    if pw is None or not _onednn_available():
        return None
    try:
        od = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
    except (RuntimeError, AttributeError):
        return None
    n, k = weight.shape
    gen = torch.Generator().manual_seed(0)
    faster: list[bool] = []
    ratios: list[float | None] = []
    spent = 0.0
    for m in buckets:
        if spent > shape_budget_s and faster:
            faster.append(faster[-1])
            ratios.append(None)
            continue
        x = (torch.randn(m, k, generator=gen) * 0.5).to(weight.dtype)
        start = time.perf_counter()
        gemm.packed_linear(x, pw)  # warm-up (and a first estimate)
        torch.ops.mkldnn._linear_pointwise(x, od, None, "none", [], "")
        pair = time.perf_counter() - start
        reps = max(_MIN_REPS, min(_MAX_REPS, int(bucket_budget_s / max(pair, 1e-6))))
        times: dict[str, list[float]] = {"native": [], "onednn": []}
        for r in range(reps):
            for cand in (("native", "onednn") if r % 2 == 0 else ("onednn", "native")):  # alternate the order
                t0 = time.perf_counter()
                if cand == "native":
                    gemm.packed_linear(x, pw)
                else:
                    torch.ops.mkldnn._linear_pointwise(x, od, None, "none", [], "")
                times[cand].append(time.perf_counter() - t0)
        spent += time.perf_counter() - start
        ratio = _low_quartile(times["native"]) / _low_quartile(times["onednn"])
        faster.append(ratio < 1.0)
        ratios.append(round(ratio, 3))
    log.info("gemm choice for %s: native/oneDNN time ratios %s", _shape_key(n, k, weight.dtype),
             dict(zip(buckets, ratios)))
    return GemmChoice(tuple(buckets), tuple(faster), tuple(ratios))


def choose(weight: torch.Tensor) -> GemmChoice | None:
    """The measured choice for ``weight``'s shape and dtype (measured on first use per machine, then
    read from the JSON cache); None when the native kernel cannot run this weight (the caller uses
    oneDNN or ``F.linear``). ``XLLM_GEMM=native|onednn`` forces the answer."""
    if not gemm.pack_supported(weight):
        return None
    force = os.environ.get(FORCE_ENV, "auto").lower()
    if force == "native":
        return forced(True)
    if force == "onednn":
        return forced(False)
    if not _onednn_available():
        return forced(True)
    return _lookup_or_measure(weight)


def _lookup_or_measure(weight: torch.Tensor) -> GemmChoice | None:
    n, k = weight.shape
    key = _shape_key(n, k, weight.dtype)
    path = _cache_file()
    entry = _read(path).get(key)  # the file is replaced atomically: no lock needed to read it
    if entry is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process measures a shape; the others read its result
            table = _read(path)
            if key not in table:
                choice = measure(weight)
                if choice is None:
                    return None
                table[key] = asdict(choice)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
                tmp.replace(path)
            entry = table[key]
    return GemmChoice(tuple(entry["buckets"]), tuple(entry["native_faster"]),
                      tuple(entry.get("ratios") or ()))


def _read(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
