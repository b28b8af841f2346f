"""Weights on 2 MiB transparent huge pages against 4 KiB pages: engine decode steps, in one process.

    python -m benchmarks hugepages                                  # q4_1, q8_0, bf16, w8a8 at 1 and 64 decodes
    python -m benchmarks hugepages --formats q8_0 --batch 1 --rounds 20

Per format (``--formats``, the names of ``benchmarks.quant``: ``q4_1`` the bundled GGUF as stored, ``q8_0`` /
``q4_0`` its requantized files, ``bf16`` / ``int8`` / ``int4`` / ``w8a8`` from its dequantized weights) the
model is loaded twice, as ``xllm serve`` loads it (:func:`xllm.models.placement.place_weights` at the end):
once with huge pages and once with ``XLLM_HUGEPAGES=0``. For each batch size (``--batch``: that many
sequences of 32-token prompts, 160 for batches above one, decoding greedily) one engine per copy runs its
sequences into steady decode, then the two take turns: ``--rounds`` rounds of 3 warm-up steps and 10
timed ``LLMEngine.step()`` calls each, so a slow minute of a shared machine lands on both. Reported: the
median and best step time per copy, and the 4 KiB / huge speed ratio. Results: ``results.json``,
``summary.md`` and ``hugepages.png`` in ``--out`` (default ``benchmarks/results/hugepages-<timestamp>``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario

PAGES = ("huge", "4k")


def _engine(model, tokenizer, max_batch: int):
    import torch

    from xllm.core import EngineConfig, LLMEngine

    return LLMEngine(model, tokenizer, EngineConfig(dtype=torch.bfloat16, max_num_seqs=max(64, max_batch),
                                                    num_threads=2, kv_cache_memory_gib=1.0,
                                                    max_num_batched_tokens=512))


def _start(eng, batch: int, seed: int) -> None:
    """``batch`` greedy sequences (32-token prompts, 160 above one) decoding steadily in ``eng``."""
    import torch

    from xllm.proto.engine.v1 import engine_pb2

    gen = torch.Generator().manual_seed(seed)
    for i in range(batch):
        ids = torch.randint(100, 40000, (160 if batch > 1 else 32,), generator=gen).tolist()
        eng.add_request(engine_pb2.GenerateRequest(
            request_id=f"b{batch}-{i}", prompt_token_ids=ids,
            sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=1024, ignore_eos=True)))
    while not eng.all_decoding():
        eng.step()


def _stop(eng) -> None:
    for request_id in eng.unfinished_request_ids():
        eng.abort(request_id)
    while eng.has_work():
        eng.step()


def measure(fmt: str, batches: list[int], rounds: int, files, log=print) -> dict:
    """Step times of ``fmt``'s model on each kind of page, per batch size, the two interleaved."""
    from benchmarks.quality import load_variant

    engines = {}
    for pages in PAGES:
        os.environ["XLLM_HUGEPAGES"] = "1" if pages == "huge" else "0"
        model, tok = load_variant(fmt, files, 2)
        engines[pages] = _engine(model, tok, max(batches))
    os.environ.pop("XLLM_HUGEPAGES", None)
    out = {}
    for batch in batches:
        for eng in engines.values():
            _start(eng, batch, seed=batch)
        times: dict[str, list[float]] = {pages: [] for pages in engines}
        for _ in range(rounds):
            for pages, eng in engines.items():
                for _ in range(3):
                    eng.step()
                t0 = time.perf_counter()
                for _ in range(10):
                    eng.step()
                times[pages].append((time.perf_counter() - t0) / 10)
        for eng in engines.values():
            _stop(eng)
        row = {pages: {"median_ms": statistics.median(t) * 1e3, "best_ms": min(t) * 1e3} for pages, t in times.items()}
        row["speedup"] = row["4k"]["median_ms"] / row["huge"]["median_ms"]
        out[str(batch)] = row
        log(f"[hugepages] {fmt} x{batch}: huge {row['huge']['median_ms']:.2f} ms, 4 KiB {row['4k']['median_ms']:.2f} "
            f"ms per step ({row['speedup']:.2f}x)")
    for eng in engines.values():
        eng.close()  # its KV mappings count against vm.max_map_count for the next format's engines
    return out


def markdown(r: dict) -> str:
    lines = ["# Weights on huge pages vs 4 KiB pages: engine decode steps", "",
             f"{r['rounds']} interleaved rounds of 10 steps per copy; CPU busy before/after: "
             f"{r.get('cpu_busy_before', float('nan')):.0%} / {r.get('cpu_busy_after', float('nan')):.0%}.", "",
             "| weights | decoding sequences | 2 MiB pages ms/step (best) | 4 KiB pages ms/step (best) | speedup |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for fmt, rows in r["runs"].items():
        for batch, row in rows.items():
            lines.append(f"| {fmt} | {batch} | {row['huge']['median_ms']:.2f} ({row['huge']['best_ms']:.2f}) | "
                         f"{row['4k']['median_ms']:.2f} ({row['4k']['best_ms']:.2f}) | {row['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(r: dict, out: pathlib.Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(f"{fmt}\nx{b}", row) for fmt, rows in r["runs"].items() for b, row in rows.items()]
    fig, ax = plt.subplots(figsize=(1.2 * len(cells) + 2, 4))
    for i, pages in enumerate(PAGES):
        ax.bar([j + 0.4 * i for j in range(len(cells))], [row[pages]["median_ms"] for _, row in cells], 0.4,
               label="2 MiB pages" if pages == "huge" else "4 KiB pages")
    ax.set_xticks([j + 0.2 for j in range(len(cells))], [c for c, _ in cells])
    ax.set_ylabel("ms per decode step (median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "hugepages.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def record_plot(r: dict, out: pathlib.Path) -> None:
    r["plot"] = plot(r, out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--formats", default="q4_1,q8_0,bf16,w8a8", help="weight formats (q4_1,q8_0,bf16,w8a8)")
    p.add_argument("--batch", default="1,64", help="decoding sequences per step, comma-separated (1,64)")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds of 10 steps per copy (10)")
    add_output_args(p, "hugepages", report=False)


def run(args: argparse.Namespace, output: Output) -> dict | int:
    from benchmarks.machine import cpu_busy_fraction
    from benchmarks.quality import VARIANTS, gguf_files

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in VARIANTS]
    if bad:
        print(f"python -m benchmarks hugepages: unknown formats {bad} (of {', '.join(VARIANTS)})", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    output.open()
    files = gguf_files()
    results: dict = {"argv": sys.argv, "rounds": args.rounds, "runs": {}, "cpu_busy_before": cpu_busy_fraction()}
    for fmt in formats:
        results["runs"][fmt] = measure(fmt, batches, args.rounds, files, log=lambda m: print(m, flush=True))
    results["cpu_busy_after"] = cpu_busy_fraction()
    return results


SCENARIO = Scenario("hugepages", "engine steps, weights on 2 MiB vs 4 KiB pages", __doc__, add_arguments, run,
                    markdown, record_plot)
