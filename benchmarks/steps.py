"""Step profile: how long one engine step takes, by step shape and forward mode, and where the
eager path's time goes, in-process on the real model (no HTTP, no client).

    python -m benchmarks steps                       # SmolLM2 bf16, every shape, both modes
    python -m benchmarks steps --shapes 16+1x128 --reps 9

A shape ``D+PxL`` is D sequences decoding (decoder i with a ``--context`` + i % 16-token context) plus P new
prompts of L tokens prefilled in the same step; ``D`` alone is a pure decode step, ``PxL`` a
prefill-only step. For each shape, modes alternate repetition by repetition (the machine is shared:
interleaving keeps slow spells from landing on one mode):

- ``eager``: the module path (``native_decode=False``): oneDNN GEMMs, per-sequence SDPA prefill
  attention, index_put KV stores — what every step with a prefill chunk or more than 8 decodes ran
  before the fused general step;
- ``native``: the engine's default (fused decode kernel for <= 8 decodes, fused general step for
  everything else).

Each repetition times one ``LLMEngine.step()`` (scheduling, forward, sampling, output processing)
after the same setup. A ``torch.profiler`` pass over one eager step splits it by part (GEMMs,
attention, KV stores, other ops, Python outside ops; native kernels called through ctypes are not
torch ops and land in the last), and the fused steps' own phase timers (``phase_seconds`` of
:class:`xllm.models.llama_native.FusedLlamaForward`; the decode kernel's and the general step's) split
one native step. Results: ``results.json``, ``summary.md``
and ``steps.png`` in ``--out`` (default ``benchmarks/results/steps-<timestamp>``).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario

SHAPES = ("1x128", "16x128", "1x1024", "16+1x128", "15+1x512", "16", "64", "64+1x128")
MODES = ("eager", "native")
# Decoder i has context + i % 16 tokens, so the measured step's KV writes reach an untouched 4 KiB page of KV
# memory in 2 of every 16 rows (SmolLM2), near serving's 1 in 10.7. With equal contexts of 160 (a page boundary
# for SmolLM2's 384-byte K/V rows) every row of a 64-decode step did: 3,840 first-touch page faults, 6.5 of the
# step's 67.5 ms in the "rope + KV store" phase (docs/performance.md, session 16).
CONTEXT_STAGGER = 16
PARTS = {  # profiler op names -> part
    "gemm": ("mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"),
    "kv store": ("aten::_index_put_impl_",),
}


@dataclass(frozen=True)
class Shape:
    decodes: int
    prompts: int
    prompt_len: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        dec, _, pre = text.partition("+") if "+" in text else (("", "", text) if "x" in text else (text, "", ""))
        p, _, length = pre.partition("x")
        return cls(int(dec or 0), int(p or 0), int(length or 0))

    def __str__(self) -> str:
        parts = [str(self.decodes)] if self.decodes else []
        if self.prompts:
            parts.append(f"{self.prompts}x{self.prompt_len}")
        return "+".join(parts)

    @property
    def tokens(self) -> int:
        return self.decodes + self.prompts * self.prompt_len


class Bench:
    """One engine per mode over the same model; sets up a shape's decoders and times its step."""

    def __init__(self, model, tokenizer, dtype, context: int) -> None:
        import torch

        from xllm.core import EngineConfig, LLMEngine

        self.torch = torch
        self.context = context
        self.engines = {
            mode: LLMEngine(model, tokenizer, EngineConfig(
                dtype=dtype, max_num_seqs=256, num_threads=2, max_num_batched_tokens=16384,
                native_decode=mode == "native", kv_cache_memory_gib=2.0))
            for mode in MODES}
        self.gen = torch.Generator().manual_seed(0)
        self.n = 0

    def _request(self, length: int, out: int):
        from xllm.proto.engine.v1 import engine_pb2

        self.n += 1
        ids = self.torch.randint(100, 40000, (length,), generator=self.gen).tolist()
        return engine_pb2.GenerateRequest(
            request_id=f"r{self.n}", prompt_token_ids=ids,
            sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))

    def prepare(self, mode: str, shape: Shape):
        """Reset the engine, start ``shape.decodes`` decoders and queue the prompts; returns the engine
        ready for the measured step."""
        eng = self.engines[mode]
        for i in range(shape.decodes):  # staggered contexts (CONTEXT_STAGGER)
            eng.add_request(self._request(self.context + i % CONTEXT_STAGGER, 4096))
        while eng.scheduler.waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in eng.scheduler.running):
            eng.step()  # prefill the decoders: each then has one token to compute per step
        for _ in range(shape.prompts):
            eng.add_request(self._request(shape.prompt_len, 2))
        return eng

    def finish(self, eng) -> None:
        for seq in list(eng.scheduler.running) + list(eng.scheduler.waiting):
            eng.abort(seq.request_id)
        while eng.has_work():
            eng.step()

    def time_step(self, mode: str, shape: Shape) -> float:
        eng = self.prepare(mode, shape)
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        self.finish(eng)
        return dt

    def native_parts(self, shape: Shape) -> dict[str, float] | None:
        """One fused step (the decode kernel for a small pure decode, else the general step) split by the
        kernel's own phase timers (ms; None without a fused forward)."""
        eng = self.prepare("native", shape)
        fused = eng.runner.fused
        if fused is None:
            self.finish(eng)
            return None
        fused.phase_seconds = self.torch.zeros(len(fused.PHASES), dtype=self.torch.float64)
        t0 = time.perf_counter()
        eng.step()
        total = (time.perf_counter() - t0) * 1e3
        phases, fused.phase_seconds = fused.phase_seconds.tolist(), None
        self.finish(eng)
        parts: dict[str, float] = {}
        for name, sec in zip(fused.PHASES, phases):
            parts[name] = parts.get(name, 0.0) + sec * 1e3
        parts["outside the kernel (LM head, sampling, Python)"] = total - sum(phases) * 1e3
        parts["step"] = total
        return parts

    def eager_parts(self, shape: Shape) -> dict[str, float]:
        """One eager step under torch.profiler, split by part (ms)."""
        from torch.profiler import profile

        eng = self.prepare("eager", shape)
        t0 = time.perf_counter()
        with profile() as prof:
            eng.step()
        total = (time.perf_counter() - t0) * 1e3
        self.finish(eng)
        parts = dict.fromkeys([*PARTS, "other ops"], 0.0)
        ops = 0.0
        for ev in prof.key_averages():
            ms = ev.self_cpu_time_total / 1e3
            ops += ms
            part = next((p for p, names in PARTS.items() if ev.key in names), "other ops")
            parts[part] += ms
        parts["python outside ops"] = max(total - ops, 0.0)
        parts["step (profiled)"] = total
        return parts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help=f"comma-separated step shapes D+PxL (default {','.join(SHAPES)})")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated of: eager, native")
    p.add_argument("--reps", type=int, default=7, help="timed steps per shape and mode (median reported)")
    p.add_argument("--context", type=int, default=160,
                   help=f"tokens of context of the first decoding sequence "
                        f"(decoder i has this + i %% {CONTEXT_STAGGER})")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--model", type=pathlib.Path, default=None, help="model dir (default: the bundled SmolLM2)")
    p.add_argument("--stored", action="store_true",
                   help="the bundled SmolLM2's GGUF weights as stored (Q4_1), as `xllm serve` runs them by default "
                        "(default: its dequantized weights in --dtype)")
    p.add_argument("--quantization", default="none",
                   help="quantize the float weights at load, as `xllm serve --quantization` does (int8, int4, "
                        "w8a8, ...; default none)")
    add_output_args(p, "steps", report=False)


def run(args: argparse.Namespace, output: Output) -> dict | int:
    for bad, why in ((args.stored and args.model is not None, "--stored runs the bundled GGUF; leave out --model"),
                     (args.stored and args.quantization != "none",
                      "--stored serves the GGUF's own formats; leave out --quantization")):
        if bad:
            print(f"python -m benchmarks steps: error: {why}", file=sys.stderr)
            return 2
    import torch

    from benchmarks.machine import cpu_busy_fraction
    from xllm.models import Tokenizer, load_model, resolve_model
    from xllm.models.source import bundled_gguf

    torch.set_num_threads(2)
    shapes = [Shape.parse(s) for s in args.shapes.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    output.open()
    path = args.model or resolve_model()
    dtype = getattr(torch, args.dtype)
    model = load_model(path, dtype=dtype, progress=False, gguf_file=bundled_gguf() if args.stored else None,
                       quantization=args.quantization)
    bench = Bench(model, Tokenizer(path), dtype, args.context)
    meta = output.meta(model=path.name, dtype=args.dtype, weights="stored GGUF" if args.stored else (
        args.dtype if args.quantization == "none" else args.quantization), context=args.context, reps=args.reps)
    rows = []
    for shape in shapes:
        for mode in modes:  # warm-up (packing, first-use allocations)
            bench.time_step(mode, shape)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.reps):
            for mode in modes:
                times[mode].append(bench.time_step(mode, shape) * 1e3)
        row = {"shape": str(shape), "tokens": shape.tokens, **asdict(shape),
               "ms": {m: statistics.median(v) for m, v in times.items()}, "samples_ms": times}
        if "eager" in modes and shape.prompts:
            row["eager_parts_ms"] = bench.eager_parts(shape)
        if "native" in modes:
            parts = bench.native_parts(shape)
            if parts is not None:
                row["native_parts_ms"] = parts
        rows.append(row)
        print(f"[steps] {shape}: " + ", ".join(f"{m} {row['ms'][m]:.1f} ms" for m in modes), flush=True)
    meta["cpu_busy_after"] = cpu_busy_fraction()
    return {"meta": meta, "rows": rows}


def summary(results: dict) -> str:
    meta, rows = results["meta"], results["rows"]
    modes = [m for m in MODES if m in rows[0]["ms"]] if rows else []
    lines = [f"# Step profile ({meta['model']}, {meta['weights']} weights, {meta['dtype']} activations, "
             f"commit {meta['commit']})", "",
             f"Median of {meta['reps']} steps per cell, modes interleaved; decoders have "
             f"{meta['context']}+i%{CONTEXT_STAGGER}-token "
             f"contexts. CPU busy before/after: {meta['cpu_busy_before']:.0%} / {meta['cpu_busy_after']:.0%}.", "",
             "| step shape | tokens | " + " | ".join(f"{m} ms" for m in modes)
             + (" | eager / native |" if len(modes) == 2 else " |"),
             "| --- | ---: | " + " | ".join("---:" for _ in modes) + (" | ---: |" if len(modes) == 2 else " |")]
    for r in rows:
        ratio = f" | {r['ms']['eager'] / r['ms']['native']:.2f}× |" if len(modes) == 2 else " |"
        lines.append(f"| {r['shape']} | {r['tokens']} | " + " | ".join(f"{r['ms'][m]:.1f}" for m in modes) + ratio)
    for key, title in (("eager_parts_ms", "Eager step by part (ms, one step under torch.profiler, which slows "
                                           "it down)"),
                       ("native_parts_ms", "Fused general step by part (ms, one step, the kernel's phase timers)")):
        parted = [r for r in rows if key in r]
        if parted:
            names = list(parted[0][key])
            lines += ["", title + ":", "", "| step shape | " + " | ".join(names) + " |",
                      "| --- | " + " | ".join("---:" for _ in names) + " |"]
            for r in parted:
                lines.append(f"| {r['shape']} | " + " | ".join(f"{r[key][n]:.1f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    modes = list(rows[0]["ms"]) if rows else []
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        ax.bar([j + i * width for j in range(len(rows))], [r["ms"][mode] for r in rows], width, label=mode)
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(rows))], [r["shape"] for r in rows])
    ax.set_ylabel("ms per step (median)")
    ax.set_yscale("log")
    ax.set_title(f"one engine step by shape ({results['meta']['model']}, {results['meta']['dtype']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



def plot_png(results: dict, out: pathlib.Path) -> None:
    plot(results, out / "steps.png")


SCENARIO = Scenario("steps", "one engine step by shape: eager vs fused native, by part", __doc__.split("\n\n")[0],
                    add_arguments, run, summary, plot_png)
