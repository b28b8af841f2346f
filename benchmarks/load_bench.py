"""Weight-loading speed: xLLM's file-order loader against HF ``from_pretrained`` (RTP-LLM §4).

Two checkpoints: the bundled SmolLM2-135M-Instruct (one fp32 file) and a synthetic Llama-style
model with >= 1 GB of bf16 weights in several shards (generated once into
``$XLLM_CACHE_DIR/bench/synthetic-llama-1g``). Each load runs in a fresh process (imports are not
timed; the clock covers ``load_model`` / ``from_pretrained`` until the model is usable), the two
loaders alternate, and every figure is measured with a **warm** page cache (files read once
before) and a **cold** one (each shard fsynced and evicted with ``posix_fadvise(DONTNEED)``; the
resident fraction is then measured with ``mincore`` and recorded). Both loaders load in the
checkpoint's dtype, so neither casts.

    python -m benchmarks load_bench [--repeats 3] [--threads 1] [--shards 4] [--out DIR]

Writes ``load.json`` and ``load.md`` (median and min seconds, HF / xLLM ratio of the medians)
under ``benchmarks/results/load-<timestamp>/`` and prints the table.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import pathlib
import statistics
import subprocess
import sys
import time

from benchmarks.scenario import Output, Scenario

HERE = pathlib.Path(__file__).resolve().parent
SYSTEMS = ("xllm", "hf")
DISPLAY = {"xllm": "xLLM load_model", "hf": "HF from_pretrained"}

# ~537 M parameters: 1.07 GB in bf16
SYNTHETIC_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 9, "num_attention_heads": 16, "num_key_value_heads": 4,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
}


# ---- the synthetic checkpoint ------------------------------------------------------------------
def synthetic_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama tensor names and shapes of ``cfg``, in model order."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def synthetic_bytes(cfg: dict, elem: int = 2) -> int:
    return sum(elem * _numel(s) for _, s in synthetic_tensors(cfg))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def ensure_synthetic(root: pathlib.Path, shards: int = 4, seed: int = 0) -> pathlib.Path:
    """Generate the synthetic bf16 checkpoint in ``shards`` files once; reuse it afterwards."""
    import torch
    from safetensors.torch import save_file

    target = root / f"synthetic-llama-1g-{shards}shards"
    if (target / ".complete").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    tensors = synthetic_tensors(SYNTHETIC_CONFIG)
    budget = synthetic_bytes(SYNTHETIC_CONFIG) / shards
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        if size >= budget and len(groups) < shards:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += 2 * _numel(shape)
    g = torch.Generator().manual_seed(seed)
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        data = {}
        for name, shape in group:
            if name.endswith("norm.weight"):
                data[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                data[name] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            weight_map[name] = file
        save_file(data, str(target / file), metadata={"format": "pt"})
        print(f"[load-bench] wrote {file} ({sum(t.numel() for t in data.values()) * 2 / 1e6:.0f} MB)", flush=True)
    total = synthetic_bytes(SYNTHETIC_CONFIG)
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (target / "config.json").write_text(json.dumps(SYNTHETIC_CONFIG, indent=1))
    (target / ".complete").write_text("ok\n")
    return target


# ---- page cache ------------------------------------------------------------------------------
def weight_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(model_dir.glob("*.safetensors"))


def resident_fraction(path: pathlib.Path) -> float | None:
    """Fraction of ``path``'s pages in the page cache (``mincore`` on a fresh mapping); None if unavailable."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        ok = libc.mincore(ctypes.c_void_p(addr), size, vec) == 0
        libc.munmap(ctypes.c_void_p(addr), size)
        return sum(b & 1 for b in vec) / pages if ok else None
    finally:
        os.close(fd)


def evict(files: list[pathlib.Path]) -> float | None:
    """Drop ``files`` from the page cache (fsync, then ``POSIX_FADV_DONTNEED``); returns the largest
    resident fraction left afterwards (0.0 = fully cold)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    fractions = [resident_fraction(f) for f in files]
    return None if any(x is None for x in fractions) else max(fractions)


def warm(files: list[pathlib.Path]) -> None:
    for f in files:
        with f.open("rb") as fh:
            while fh.read(1 << 24):
                pass


# ---- one load in a fresh process -------------------------------------------------------------
def worker(system: str, model_dir: str, dtype_name: str, threads: int) -> dict:
    """Load once and report the seconds the load call took (imports excluded)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    post_load = None
    if system == "xllm":
        from xllm.models import ModelConfig, load_model, model_class

        cls = model_class(ModelConfig.from_dir(model_dir).architecture)
        original = cls.post_load
        timing: list[float] = []

        def timed_post_load(self) -> None:  # post_load builds runtime state (RoPE, packed weights...)
            t0 = time.perf_counter()
            original(self)
            timing.append(time.perf_counter() - t0)

        cls.post_load = timed_post_load
        start = time.perf_counter()
        model = load_model(model_dir, dtype, progress=False)
        seconds = time.perf_counter() - start
        cls.post_load = original
        post_load = timing[0] if timing else None
    else:
        from transformers import AutoModelForCausalLM

        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        seconds = time.perf_counter() - start
    embed = model.model.embed_tokens.weight
    checksum = float(embed[:64].detach().float().sum())  # both loaders must have read the same weights
    import resource

    return {"seconds": seconds, "post_load_seconds": post_load, "checksum": checksum,
            "params": sum(p.numel() for p in model.parameters()),
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure(system: str, model_dir: pathlib.Path, dtype: str, threads: int, cold: bool) -> dict:
    files = weight_files(model_dir)
    left = evict(files) if cold else None
    if not cold:
        warm(files)
    cmd = [sys.executable, "-m", "benchmarks", "load_bench", "--worker", system, "--dir", str(model_dir),
           "--dtype", dtype, "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(HERE.parent), timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} load failed:\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["resident_before"] = left if cold else 1.0
    return result


def bench_model(label: str, model_dir: pathlib.Path, dtype: str, repeats: int, threads: int) -> dict:
    files = weight_files(model_dir)
    size = sum(f.stat().st_size for f in files)
    entry: dict = {"label": label, "dir": str(model_dir), "dtype": dtype, "files": len(files), "bytes": size,
                   "runs": {}}
    for mode in ("warm", "cold"):
        runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
        if mode == "warm":  # one untimed load each: the page cache and the loaders' lazy imports settle
            for s in SYSTEMS:
                measure(s, model_dir, dtype, threads, cold=False)
        for k in range(repeats):
            for s in SYSTEMS if k % 2 == 0 else SYSTEMS[::-1]:
                r = measure(s, model_dir, dtype, threads, cold=mode == "cold")
                runs[s].append(r)
                print(f"[load-bench] {label} {mode} {s}: {r['seconds']:.2f} s", flush=True)
        entry["runs"][mode] = runs
    checks = {round(r["checksum"], 3) for m in entry["runs"].values() for rs in m.values() for r in rs}
    entry["same_weights"] = len(checks) == 1
    return entry


# ---- report ----------------------------------------------------------------------------------
def summarize(entry: dict) -> dict:
    out = {}
    for mode, runs in entry["runs"].items():
        med = {s: statistics.median(r["seconds"] for r in runs[s]) for s in SYSTEMS}
        post = [r["post_load_seconds"] for r in runs["xllm"] if r.get("post_load_seconds") is not None]
        weights_only = [r["seconds"] - (r.get("post_load_seconds") or 0.0) for r in runs["xllm"]]
        out[mode] = {"median": med, "min": {s: min(r["seconds"] for r in runs[s]) for s in SYSTEMS},
                     "xllm_post_load_median": statistics.median(post) if post else None,
                     "xllm_weights_median": statistics.median(weights_only),
                     "ratio_hf_over_xllm_weights": med["hf"] / statistics.median(weights_only),
                     "ratio_hf_over_xllm": med["hf"] / med["xllm"] if med["xllm"] else None,
                     "resident_before": max((r["resident_before"] or 0.0) for rs in runs.values() for r in rs)}
    return out


def markdown(results: dict) -> str:
    lines = ["| model | weights | page cache | xLLM load_model (s) | of which post_load (s) | HF from_pretrained (s) "
             "| HF / xLLM | HF / xLLM weights only |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in results["models"]:
        s = e["summary"]
        for mode in ("warm", "cold"):
            m = s[mode]
            cache = mode if mode == "warm" else f"cold ({m['resident_before']:.0%} resident after eviction)"
            post = _num(m.get("xllm_post_load_median"))
            lines.append(f"| {e['label']} | {e['bytes'] / 1e9:.2f} GB {e['dtype']}, {e['files']} file(s) | {cache} | "
                         f"{m['median']['xllm']:.2f} (min {m['min']['xllm']:.2f}) | {post} | "
                         f"{m['median']['hf']:.2f} (min {m['min']['hf']:.2f}) | "
                         f"**{m['ratio_hf_over_xllm']:.2f}x** | {m['ratio_hf_over_xllm_weights']:.2f}x |")
    meta = results["meta"]
    busy = [meta.get("cpu_busy_before"), meta.get("cpu_busy_after")]
    lines += ["", f"Median of {meta['repeats']} fresh-process loads per cell (loaders alternating), "
              f"torch threads = {meta['threads']}; ratio = HF median / xLLM median (> 1: xLLM faster); "
              "post_load = building runtime state after the weights are in (RoPE table, prepacked weights); "
              "weights only = xLLM load_model minus post_load. "
              f"CPU busy with other work before/after: {', '.join('–' if b is None else f'{b:.0%}' for b in busy)}; "
              f"load average {meta.get('loadavg')}. Same weights read by both loaders: "
              f"{all(e['same_weights'] for e in results['models'])}."]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads in each loading process")
    p.add_argument("--shards", type=int, default=4, help="shard files of the synthetic checkpoint")
    p.add_argument("--model", default=None, help="model dir instead of the bundled SmolLM2")
    p.add_argument("--skip-synthetic", action="store_true")
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--report", type=pathlib.Path, default=None, help="rebuild load.md from DIR/load.json")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)


def run(args: argparse.Namespace, output: Output) -> dict | int:
    if args.worker:  # one load in this fresh process (see measure)
        print(json.dumps(worker(args.worker, args.dir, args.dtype, args.threads)), flush=True)
        return 0
    from benchmarks.machine import cpu_busy_fraction
    from xllm.models import cache_dir, resolve_model

    source = pathlib.Path(args.model) if args.model else resolve_model(progress=False)
    # a private copy: pages another process keeps mapped (a server or test run using the shared
    # cached model) cannot be evicted, which would make the "cold" runs warm
    smol = private_copy(source, cache_dir() / "bench")
    models = [("SmolLM2-135M-Instruct" if not args.model else source.name, smol, _stored_dtype(smol))]
    if not args.skip_synthetic:
        synth = ensure_synthetic(cache_dir() / "bench", args.shards)
        models.append(("synthetic Llama 537M", synth, "bfloat16"))
    meta = output.meta(repeats=args.repeats, threads=args.threads, loadavg=_loadavg())
    results = {"meta": meta, "models": []}
    for label, path, dtype in models:
        entry = bench_model(label, path, dtype, args.repeats, args.threads)
        entry["summary"] = summarize(entry)
        results["models"].append(entry)
    meta["cpu_busy_after"] = cpu_busy_fraction()
    return results


def reload(results: dict, args: argparse.Namespace) -> None:
    """``--report DIR``: the summaries again from the runs in ``load.json``."""
    for entry in results["models"]:
        entry["summary"] = summarize(entry)


def summary(results: dict) -> str:
    return "# Weight loading: xLLM vs HF from_pretrained\n\n" + markdown(results)


SCENARIO = Scenario("load_bench", "weight loading: xLLM's loader vs HF from_pretrained, warm and cold page cache",
                    __doc__.split("\n\n")[0], add_arguments, run, summary, reload=reload, prefix="load",
                    files=("load.json", "load.md"))


def private_copy(src: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    """A copy of model dir ``src`` under ``root`` that only this benchmark reads (made once)."""
    import shutil

    target = root / f"{src.name}-copy"
    if not (target / ".complete").is_file():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(src, target)
        (target / ".complete").write_text("ok\n")
    return target


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _stored_dtype(model_dir: pathlib.Path) -> str:
    cfg = json.loads((model_dir / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def _loadavg() -> str | None:
    try:
        return " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return None
