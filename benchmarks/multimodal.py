"""The encode phase of image requests, measured: ``python -m benchmarks multimodal [--requests 24] [--rate 2]``.

One in-process engine serves a random-weight Qwen2-VL (``--model-size small``: a 12-layer vision tower of width
512 and an 8-layer language model of width 576, about 80M weights, fp32; ``tiny`` for the harness's test; made
once and cached under ``$XLLM_CACHE_DIR/bench-models``) a Poisson stream of chat requests, ``--image-fraction``
of them with one ``--image-size`` image (random pixels, each image distinct), text prompts of ``--prompt``
tokens, ``--tokens`` tokens out (fixed: ``ignore_eos``). The same arrivals run with the encode phase off (each
image encoded in its request's first prefill chunk) and on with each ``--max-encode-images`` bound (images
encoded in steps of their own, before their prefill, only while no prompt is mid-prefill;
:mod:`xllm.sched.encode`). Reported per configuration and per kind of request (image, text): TTFT and TPOT
percentiles, SLO attainment and goodput under ``--slo-ttft-ms`` / ``--slo-tpot-ms``, and the longest step that
carried decode rows; plus a plot.

No peer runs here: vLLM-CPU has no random-weight VLM path in this harness yet, and the E/P/D split of the issue
is not built. Figures: ``docs/performance.md`` ("The encode phase of image requests").
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.report import add_output_args, fmt
from benchmarks.scenario import Output, Scenario, attempt
from benchmarks.stats import SLO, RequestRecord, serving_summary
from benchmarks.vl_models import IMAGE_PAD, SIZES, VOCAB, latency_bars_by_kind, model_dir
from xllm.common.argtypes import fraction, int_list_at_least, positive_float, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-size", choices=sorted(SIZES), default="small", help="the random model's size (small)")
    p.add_argument("--requests", type=positive_int, default=24, help="requests per configuration (24)")
    p.add_argument("--rate", type=positive_float, default=2.0, help="Poisson arrivals, requests/s (2)")
    p.add_argument("--image-fraction", type=fraction, default=0.5, help="share of requests with an image (0.5)")
    p.add_argument("--image-size", type=positive_int, default=224, help="image side in pixels, a multiple of 28 (224)")
    p.add_argument("--prompt", type=positive_int, default=64, help="text prompt tokens (64)")
    p.add_argument("--tokens", type=positive_int, default=32, help="output tokens per request (32)")
    p.add_argument("--max-encode-images", type=int_list_at_least(0), default=[0, 1, 4],
                   help="encode-phase bounds to compare; 0 = the phase off (0,1,4)")
    p.add_argument("--slo-ttft-ms", type=positive_float, default=2000.0, help="TTFT objective (2000)")
    p.add_argument("--slo-tpot-ms", type=positive_float, default=150.0, help="TPOT objective (150)")
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads (2)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    add_output_args(p, "multimodal")


def workload(args: argparse.Namespace, patch_dim: int) -> list[tuple[float, list[int], object]]:
    """(arrival, prompt ids, image pixels or None) per request, the same for every configuration."""
    import torch

    rng = random.Random(args.seed)
    side = args.image_size // 14
    g = torch.Generator().manual_seed(args.seed)
    t, out = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        text = [rng.randrange(VOCAB) for _ in range(args.prompt)]
        if rng.random() < args.image_fraction:
            pixels = torch.randn(side * side, patch_dim, generator=g)
            text = text[:8] + [VOCAB] + [IMAGE_PAD] * (side * side // 4) + [VOCAB + 2] + text[8:]
            out.append((t, text, pixels))
        else:
            out.append((t, text, None))
    return out


def run_once(model, work, args: argparse.Namespace, bound: int) -> dict:
    """One configuration over ``work`` in real time; its records by kind and its longest decode-carrying step."""
    import torch

    from xllm.core import EngineConfig, LLMEngine
    from xllm.proto.engine.v1 import engine_pb2
    from xllm.testing.models import IdTokenizer

    side = args.image_size // 14
    engine = LLMEngine(model, IdTokenizer(), EngineConfig(dtype=torch.float32, max_model_len=1024, max_num_seqs=16,
                                                          kv_cache_memory_gib=0.5, num_threads=args.threads,
                                                          max_encode_images=bound))
    records: dict[str, RequestRecord] = {}
    kinds: dict[str, str] = {}
    first_at: dict[str, float] = {}
    pending = list(enumerate(work))
    longest = 0.0
    t0 = time.perf_counter()
    while pending or engine.has_work():
        now = time.perf_counter() - t0
        while pending and pending[0][1][0] <= now:
            i, (arrival, ids, pixels) = pending.pop(0)
            rid = f"r{i}"
            req = engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=engine_pb2.SamplingParams(
                temperature=0, max_tokens=args.tokens, ignore_eos=True))
            if pixels is not None:
                req.images.append(engine_pb2.ImageInput(pixel_values=pixels.numpy().tobytes(), grid_thw=[1, side, side],
                                                        content_hash=f"img{args.seed}-{i}".encode()))
            engine.add_request(req)
            records[rid] = RequestRecord(prompt_tokens=len(ids), start=arrival)
            kinds[rid] = "image" if pixels is not None else "text"
        if not engine.has_work():
            time.sleep(max(0.0, pending[0][1][0] - now))
            continue
        began = time.perf_counter()
        chunks = engine.step()
        end = time.perf_counter()
        if any(c.token_ids and c.request_id in first_at for c in chunks):  # a step that carried decode rows
            longest = max(longest, end - began)
        for c in chunks:
            r = records[c.request_id]
            at = end - t0 - r.start
            if c.token_ids and c.request_id not in first_at:
                first_at[c.request_id] = at
                r.ttft = at
            r.output_tokens += len(c.token_ids)
            if c.finish_reason:
                r.e2e = at
    engine.close()
    return {"records": records, "kinds": kinds, "duration": time.perf_counter() - t0, "longest_decode_step": longest,
            "encoder": {"images_encoded": engine.runner.encoder_cache.misses,
                        "in_phase": engine.runner.encoder_cache.phase_images}}


def run(args: argparse.Namespace, output: Output) -> dict | int:
    import torch

    if args.image_size % 28:
        print("[multimodal] --image-size must be a multiple of 28 (whole 2x2 merge blocks of 14-pixel patches)")
        return 2
    output.open()
    torch.set_num_threads(args.threads)
    from xllm.models.qwen_vl import load_qwen_vl

    model = load_qwen_vl(model_dir(args.model_size), torch.float32)
    work = workload(args, model.patch_dim())
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    results: dict = {"meta": output.meta(args), "configs": {}, "errors": {},
                     "workload": {"images": sum(p is not None for _, _, p in work), "requests": len(work),
                                  "image_tokens": (args.image_size // 28) ** 2}}
    run_once(model, work[:2], args, 0)  # warm-up (allocations, kernel choices)
    for bound in args.max_encode_images:
        name = "phase off" if bound == 0 else f"phase, {bound} per step"
        got = attempt(results["errors"], name, "multimodal", run_once, model, work, args, bound)
        if got is None:
            continue
        row = {"max_encode_images": bound, "longest_decode_step_ms": got["longest_decode_step"] * 1e3,
               **got["encoder"]}
        for kind in ("image", "text", "all"):
            recs = [r for rid, r in got["records"].items() if kind == "all" or got["kinds"][rid] == kind]
            if recs:
                row[kind] = serving_summary(recs, got["duration"], slo)
        results["configs"][name] = row
        print(f"[multimodal] {name}: TTFT p90 image {fmt(row.get('image', {}).get('ttft_ms', {}).get('p90'))} ms, "
              f"text {fmt(row.get('text', {}).get('ttft_ms', {}).get('p90'))} ms; TPOT p90 "
              f"{fmt(row['all']['tpot_ms'].get('p90'))} ms; longest decode step {row['longest_decode_step_ms']:.0f} ms",
              flush=True)
        output.save(results, summary)
    return results


def summary(results: dict) -> str:
    meta = results["meta"]
    cpu = meta.get("machine", {}).get("cpu_model", "?")
    w = results["workload"]
    lines = [f"# The encode phase of image requests ({cpu})", "",
             f"{w['requests']} requests at {meta['rate']} req/s, {w['images']} with one {meta['image_size']}-pixel "
             f"image ({w['image_tokens']} image tokens), {meta['prompt']} text tokens, {meta['tokens']} out; "
             f"model `{meta['model_size']}`; SLO TTFT <= {meta['slo_ttft_ms']:g} ms, TPOT <= "
             f"{meta['slo_tpot_ms']:g} ms.", "",
             "| configuration | kind | TTFT p50 | p90 | TPOT p50 | p90 | p99 | SLO attainment | longest decode "
             "step (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in results["configs"].items():
        for kind in ("image", "text", "all"):
            s = row.get(kind)
            if s is None:
                continue
            lines.append(f"| {name} | {kind} | {fmt(s['ttft_ms'].get('p50'))} | {fmt(s['ttft_ms'].get('p90'))} | "
                         f"{fmt(s['tpot_ms'].get('p50'))} | {fmt(s['tpot_ms'].get('p90'))} | "
                         f"{fmt(s['tpot_ms'].get('p99'))} | {fmt(100 * s.get('slo_attainment', float('nan')))} % | "
                         f"{row['longest_decode_step_ms']:.0f} |")
    for name, err in results.get("errors", {}).items():
        lines.append(f"\n{name} failed: {err}")
    return "\n".join(lines) + "\n"


def plot(results: dict, out_dir) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    latency_bars_by_kind(axes[:2], results["configs"])
    fig.suptitle("Image requests: encode phase off vs on")
    fig.tight_layout()
    path = out_dir / "multimodal.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]


SCENARIO = Scenario("multimodal", "image requests: the encode phase off vs on (per-step bounds), in-process",
                    __doc__, add_arguments, run, summary, plot)
