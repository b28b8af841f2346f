"""The native CPU kernels (C, AVX-512 + BF16, OpenMP): built on first use, loaded with ctypes.

Sources live in the repository's ``kernels/cpu/`` (shipped inside the wheel as
``xllm/kernels/csrc``). The first process that needs them compiles one shared
library with the system C compiler into ``$XLLM_CACHE_DIR/kernels/<key>/`` (a
few seconds; the key covers the sources, flags and CPU features), later
processes load it. Everything here has a pure-torch fallback: when there is no
compiler, the CPU lacks AVX-512 BF16, or ``XLLM_NATIVE=0`` is set,
:func:`library` returns ``None`` and callers use torch ops.

CPUs with AVX2 + FMA + F16C but no AVX-512 (AMD Zen 1-3, most Intel client parts) get a second, smaller
library from ``kernels/cpu/avx2`` (:func:`avx2_library`): the quantized products, which
:mod:`xllm.kernels.quant_native` uses where :func:`library` is None, and the bf16 and decode-sized fp32
GEMMs, which :func:`xllm.kernels.linear.linear` uses there (torch's own bf16 GEMM on such a CPU runs at
about 1 GFLOP/s); every other op takes torch there.
``XLLM_NATIVE_ISA=avx2`` makes any CPU behave so (tests and benchmarks of the AVX2 path on AVX-512 machines).

The library links the same OpenMP runtime as torch (``libgomp.so.1``, already
loaded by ``import torch``), so both share one thread pool.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time

import torch

from xllm.common import cache_dir

log = logging.getLogger(__name__)

_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
#: the AVX2 library (``kernels/cpu/avx2``: the quantized products only) for CPUs without AVX-512; built for
#: exactly these extensions (not -march=native), so an AVX-512 machine builds and tests the same code
_AVX2_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-mtune=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")
_lock = threading.Lock()


class LlamaCfg(ctypes.Structure):
    """Mirror of ``XllmLlamaCfg`` in kernels/cpu/llama_step.c."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "hidden", "n_heads", "n_kv_heads", "head_dim", "inter", "n_layers",
        "k_slot_stride", "k_tok_stride", "v_slot_stride", "v_tok_stride")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("qk_norm", ctypes.c_int32),
        ("rotary_dim", ctypes.c_int32), ("kv_quant", ctypes.c_int32),
        # the rank's shared-memory group (xllm_shm_* context, :meth:`xllm.core.parallel.shm.ShmComm.native_handle`)
        # of a tensor-parallel shard: the steps all-reduce the O and down projections' partial sums; None: one process
        ("comm", ctypes.c_void_p)]

#: ``XllmLlamaCfg.kv_quant`` of each KV row format (None: the model dtype; strides then in elements)
KV_QUANT_TAGS: dict[str | None, int] = {None: 0, "int8": 1, "fp8_e4m3": 2}


class QWeight(ctypes.Structure):
    """Mirror of ``XllmQWeight`` (kernels/cpu/gemm_quant.h): a quantized weight's format tag (0: none)
    and data pointers (see :mod:`xllm.kernels.quant_native`)."""

    _fields_ = [("fmt", ctypes.c_int64), ("data", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("zeros", ctypes.c_void_p), ("packed", ctypes.c_void_p)]


class LlamaLayer(ctypes.Structure):
    """Mirror of ``XllmLlamaLayer``: data pointers of one layer's weights, KV cache and packed weights,
    then the quantized weights (``fmt`` 0 where a projection is a plain matrix)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "ln1", "qkv_w", "qkv_b", "q_norm", "k_norm", "o_w", "o_b", "ln2", "gate_up_w", "down_w", "k_cache",
        "v_cache", "qkv_wp", "o_wp", "gate_up_wp", "down_wp")] + [
        (name, QWeight) for name in ("qkv_q", "o_q", "gate_up_q", "down_q")]


class LoraProj(ctypes.Structure):
    """Mirror of ``XllmLoraProj`` (kernels/cpu/llama_step.c): one projection's stacked LoRA adapters in the fused
    steps (``a`` None: no adapter on it)."""

    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("n", ctypes.c_int64), ("rank", ctypes.c_int64),
                ("n_parts", ctypes.c_int64), ("part_start", ctypes.c_int64 * 3), ("part_size", ctypes.c_int64 * 3)]


class LoraLayer(ctypes.Structure):
    """Mirror of ``XllmLoraLayer``: a layer's four adapted projections."""

    _fields_ = [(name, LoraProj) for name in ("qkv", "o", "gate_up", "down")]


class LoraGroups(ctypes.Structure):
    """Mirror of ``XllmLoraGroups`` (kernels/cpu/lora_team.h): rows grouped by adapter slot (int64 arrays)."""

    _fields_ = [("order", ctypes.c_void_p), ("gslot", ctypes.c_void_p), ("gstart", ctypes.c_void_p),
                ("groups", ctypes.c_int64)]


class LoraStep(ctypes.Structure):
    """Mirror of ``XllmLoraStep``: a fused step's adapter rows (its last argument; NULL for the base model alone)."""

    _fields_ = [("layers", ctypes.POINTER(LoraLayer)), ("groups", LoraGroups), ("scale", ctypes.c_void_p),
                ("tmp", ctypes.c_void_p)]


class NativeLibrary:
    """ctypes bindings of ``libxllm_cpu.so`` (argument types declared once)."""

    def __init__(self, path: pathlib.Path, hold_gil: bool | None = None, isa: str = "avx512") -> None:
        self.path = path
        #: "avx512" (every kernel of kernels/cpu) or "avx2" (kernels/cpu/avx2: the quantized products and the
        #: bf16/fp32 GEMMs)
        self.isa = isa
        if hold_gil is None:
            hold_gil = os.environ.get("XLLM_NATIVE_RELEASE_GIL", "0") != "1"
        # Holding the GIL (PyDLL) keeps other Python threads (the HTTP event loop) off the CPU while
        # a kernel's OpenMP team runs: on a machine with as many threads as cores, a thread woken
        # mid-kernel preempts one team member and every barrier waits for it.
        self.holds_gil = hold_gil
        lib = (ctypes.PyDLL if hold_gil else ctypes.CDLL)(str(path))
        self.lib = lib
        self._declared: dict[str, object] = {}
        vp, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        lib.xllm_gemm_bf16.argtypes = [vp, i64, i64, vp, i64, vp, vp, i32]  # (both libraries: any M on AVX2)
        lib.xllm_gemm_f32.argtypes = [vp, i64, i64, vp, i64, vp, vp]
        lib.xllm_gemm_bf16.restype = lib.xllm_gemm_f32.restype = None
        if isa != "avx512":
            return
        lib.xllm_gemm_f32.argtypes = [vp, i64, i64, vp, i64, vp, vp]
        for name in ("xllm_decode_attention_bf16", "xllm_decode_attention_f32"):
            getattr(lib, name).argtypes = [vp, vp, vp, i64, i64, i64, i64, vp, vp, i64, i64, i64, i64, i64, f32, vp,
                                           vp, vp]
        for name in ("xllm_llama_decode_bf16", "xllm_llama_decode_f32"):
            getattr(lib, name).argtypes = [ctypes.POINTER(LlamaCfg), ctypes.POINTER(LlamaLayer), i64, vp, vp, vp,
                                           vp, vp, vp, vp, vp, ctypes.POINTER(LoraStep)]
        for name in ("xllm_llama_forward_bf16", "xllm_llama_forward_f32"):
            getattr(lib, name).argtypes = [ctypes.POINTER(LlamaCfg), ctypes.POINTER(LlamaLayer), i64, vp, vp, i64,
                                           vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(LoraStep)]
        for sfx in ("bf16", "f32"):
            getattr(lib, f"xllm_add_rmsnorm_{sfx}").argtypes = [vp, vp, vp, vp, i64, i64, f32, vp]
            getattr(lib, f"xllm_silu_mul_{sfx}").argtypes = [vp, i64, i64, vp]
            getattr(lib, f"xllm_rope_{sfx}").argtypes = [vp, i64, i64, i64, i64, vp, vp, vp, i64]
        lib.xllm_argmax_f32.argtypes = [vp, i64, i64, vp]
        lib.xllm_argmax_f32.restype = None
        for name in ("decode_attention", "add_rmsnorm", "silu_mul", "rope"):
            for sfx in ("bf16", "f32"):
                getattr(lib, f"xllm_{name}_{sfx}").restype = None
        for name in ("llama_decode", "llama_forward"):  # 0, or a failed collective's XSHM_* code (shm_allreduce.h)
            for sfx in ("bf16", "f32"):
                getattr(lib, f"xllm_{name}_{sfx}").restype = ctypes.c_int

    def fn(self, name: str, argtypes: list, restype=None):
        """The C function ``name`` with its signature declared (once; kernel modules declare their own)."""
        f = self._declared.get(name)
        if f is None:
            f = getattr(self.lib, name)
            f.argtypes, f.restype = argtypes, restype
            self._declared[name] = f
        return f


def _sources_dir() -> pathlib.Path | None:
    here = pathlib.Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parents[4] / "kernels" / "cpu"):
        if (candidate / "gemm.c").is_file():
            return candidate
    return None


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``), read once."""
    return frozenset(_cpu_flags())


@dataclasses.dataclass(frozen=True)
class _Variant:
    """One build of the kernel sources: which directory, for which CPU extensions, into which library."""

    isa: str  # NativeLibrary.isa
    subdir: str  # under the sources dir ("" for kernels/cpu itself)
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]  # required in /proc/cpuinfo
    lib_name: str


_AVX512 = _Variant("avx512", "", tuple(_CFLAGS), _REQUIRED_CPU_FLAGS, "libxllm_cpu.so")
_AVX2 = _Variant("avx2", "avx2", tuple(_AVX2_CFLAGS), _AVX2_CPU_FLAGS, "libxllm_cpu_avx2.so")


def _variant_reason(v: _Variant) -> str | None:
    """Why ``v`` cannot be built and run here, or None if it can."""
    if os.environ.get("XLLM_NATIVE", "1") == "0":
        return "disabled by XLLM_NATIVE=0"
    if v is _AVX512 and os.environ.get("XLLM_NATIVE_ISA") == "avx2":
        return "XLLM_NATIVE_ISA=avx2 (the AVX2 library only, as on a CPU without AVX-512)"
    missing = [f for f in v.cpu_flags if f not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    src = _sources_dir()
    if src is None or not (src / v.subdir).is_dir():
        return "kernel sources not found"
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        return "no C compiler (set CC or install gcc)"
    return None


def unavailable_reason() -> str | None:
    """Why the native kernels cannot be used here, or None if they can."""
    return _variant_reason(_AVX512)


def _parent_includes(src: pathlib.Path) -> list[str]:
    """The parent directory's C files that ``src``'s sources include (``#include "../name.c"``): part of the key."""
    names = set()
    for f in src.glob("*.c"):
        for line in f.read_text().splitlines():
            if line.startswith('#include "../') and line.rstrip().endswith('.c"'):
                names.add(line.split('"')[1][3:])
    return sorted(n for n in names if (src.parent / n).is_file())


def _build(src: pathlib.Path, cflags: list[str], name: str) -> pathlib.Path:
    """The shared library of ``src``'s top-level C files, compiled with ``cflags`` into a cache directory keyed
    by the sources, the flags and the CPU's features (built once, under a file lock across processes)."""
    cc = os.environ.get("CC", "gcc")
    files = sorted(src.glob("*.c")) + sorted(src.glob("*.h"))
    if (src.parent / "quant_formats.h").is_file():  # (avx2/ includes ../quant_formats.h, ../shm_allreduce.c)
        files += sorted(src.parent.glob("*.h")) + [src.parent / n for n in _parent_includes(src)]
    key = hashlib.sha256()
    for f in files:
        key.update(f.name.encode() + f.read_bytes())
    key.update(" ".join([cc, *cflags]).encode())
    key.update(" ".join(sorted(_cpu_flags())).encode())
    out_dir = cache_dir("kernels") / key.hexdigest()[:16]
    lib = out_dir / name
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.is_file():
            return lib
        log.info("building native CPU kernels with %s (first use only)", cc)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            target = pathlib.Path(tmp) / lib.name
            cmd = [cc, *cflags, *[str(f) for f in sorted(src.glob("*.c"))], "-o", str(target), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"building the native kernels failed:\n{' '.join(cmd)}\n{result.stderr}")
            target.rename(lib)
        log.info("native CPU kernels built in %.1fs: %s", time.perf_counter() - start, lib)
    return lib


@functools.cache
def _load(v: _Variant) -> NativeLibrary | None:
    """``v``'s library, built on first use; None (logged) where it cannot be built or run."""
    reason = _variant_reason(v)
    if reason is not None:
        log.info("native CPU kernels (%s) unavailable (%s); using torch ops", v.isa, reason)
        return None
    try:
        return NativeLibrary(_build(_sources_dir() / v.subdir, list(v.cflags), v.lib_name), isa=v.isa)
    except (RuntimeError, OSError) as exc:
        log.warning("native CPU kernels (%s) unavailable, using torch ops: %s", v.isa, exc)
        return None


def build_from(src: pathlib.Path) -> NativeLibrary:
    """A library built from other kernel sources (a ``kernels/cpu`` directory), cached like the default one:
    benchmarks load it beside :func:`library` for a before/after of a kernel change in one process."""
    return NativeLibrary(_build(src, list(_AVX512.cflags), _AVX512.lib_name))


def library() -> NativeLibrary | None:
    """The loaded native library, building it on first use; None means use torch."""
    with _lock:
        return _load(_AVX512)


def avx2_unavailable_reason() -> str | None:
    """Why the AVX2 library (:func:`avx2_library`) cannot be used here, or None if it can."""
    return _variant_reason(_AVX2)


def avx2_library() -> NativeLibrary | None:
    """The AVX2 + FMA + F16C library (``kernels/cpu/avx2``: the quantized products of
    :mod:`xllm.kernels.quant_native` and the bf16 and fp32 GEMMs of :func:`xllm.kernels.linear.linear`, same entry
    points), built on first use; None where it cannot run. Both take it where :func:`library` is unavailable
    (CPUs without AVX-512)."""
    with _lock:
        return _load(_AVX2)


def for_tensors(*tensors: torch.Tensor) -> NativeLibrary | None:
    """The library if it can run on these tensors: CPU, one dtype of bf16/fp32,
    contiguous, and not being traced by ``torch.compile``; else None."""
    if torch.compiler.is_compiling():
        return None
    dtype = tensors[0].dtype
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
            return None
    return library()


def suffix(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "f32"
