"""Quantized KV cache (``--kv-cache-dtype int8|fp8_e4m3``) against the model-dtype cache, SmolLM2-135M bf16.

    python -m benchmarks kv_quant                       # quality + decode speed, 2 threads
    python -m benchmarks kv_quant --skip-speed --threads 1
    OMP_NUM_THREADS=1 python -m benchmarks kv_quant --kernel-only --threads 1   # the decode attention kernel

Quality (the held-out ``benchmarks/data/romeo-and-juliet-3-1.txt``, never a benchmark prompt):

- perplexity of the text through one request with ``prompt_logprobs`` (teacher-forced; the prompt runs
  as prefill chunks over the quantized cache of the earlier chunks), the mean |Δlogprob| of its tokens
  against the ``auto`` cache and the share of positions whose top-1 token is unchanged;
- greedy agreement: ``--prompts`` windows of the text, ``--greedy-len`` greedy tokens each (the decode
  path), against the ``auto`` cache: identical continuations and the mean share of tokens before the
  first difference. ``auto-eager`` (the ``auto`` cache through the eager modules, ``--no-native-decode``)
  shows how much of the difference any change of kernels makes.

Speed: decode tok/s per sequence at a long context (``--context`` prompt tokens, ``--batch`` sequences,
``--decode`` tokens each), the median of the decode steps' wall time, variants run interleaved
``--repeats`` times. ``auto``, ``int8`` and ``fp8_e4m3`` run the fused native steps (over quantized
rows for the last two); ``auto-eager`` the eager modules.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import statistics
import time

from benchmarks.scenario import Output, Scenario

HERE = pathlib.Path(__file__).resolve().parent
TEXT = HERE / "data" / "romeo-and-juliet-3-1.txt"
QUALITY = ("auto", "auto-eager", "int8", "fp8_e4m3")
SPEED = ("auto", "auto-eager", "int8", "fp8_e4m3")


def _engine(model, tokenizer, variant: str, threads: int, max_len: int, memory_gib: float = 1.0):
    import torch

    from xllm.core import EngineConfig, LLMEngine

    kind = "auto" if variant.startswith("auto") else variant
    return LLMEngine(model, tokenizer, EngineConfig(
        dtype=torch.bfloat16, max_model_len=max_len, num_threads=threads, kv_cache_memory_gib=memory_gib,
        kv_cache_dtype=kind, native_decode=variant != "auto-eager", max_num_seqs=16))


def _drain(engine, requests) -> dict:
    out: dict = {"tokens": {}, "prompt": []}
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        for c in engine.step():
            out["tokens"].setdefault(c.request_id, []).extend(c.token_ids)
            out["prompt"].extend((lp.logprob, lp.top[0].token_id if lp.top else -1) for lp in c.prompt_logprobs)
    return out


def quality(model, tokenizer, ids: list[int], prompts: list[list[int]], n: int, threads: int) -> dict:
    from xllm.proto.engine.v1 import engine_pb2

    sp = engine_pb2.SamplingParams
    raw = {}
    for variant in QUALITY:
        eng = _engine(model, tokenizer, variant, threads, 4096)
        scored = _drain(eng, [engine_pb2.GenerateRequest(
            request_id="text", prompt_token_ids=ids, sampling=sp(temperature=0, max_tokens=1, prompt_logprobs=1))])
        greedy = _drain(eng, [engine_pb2.GenerateRequest(
            request_id=f"g{i}", prompt_token_ids=p, sampling=sp(temperature=0, max_tokens=n, ignore_eos=True))
            for i, p in enumerate(prompts)])
        raw[variant] = (scored["prompt"], [greedy["tokens"][f"g{i}"] for i in range(len(prompts))])
        eng.close()
    base_lp, base_greedy = raw["auto"]
    results = {}
    for variant, (lps, greedy) in raw.items():
        nll = -sum(lp for lp, _ in lps) / len(lps)
        same, prefix = 0, 0.0
        for got, want in zip(greedy, base_greedy, strict=True):
            k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
            same += k == len(want)
            prefix += k / len(want)
        results[variant] = {
            "perplexity": math.exp(nll),
            "mean_abs_dlogprob": sum(abs(a[0] - b[0]) for a, b in zip(lps, base_lp, strict=True)) / len(lps),
            "top1_agreement": sum(a[1] == b[1] for a, b in zip(lps, base_lp, strict=True)) / len(lps),
            "greedy_identical": same / len(prompts), "greedy_prefix_agreement": prefix / len(prompts)}
    return results


def speed(model, tokenizer, ids: list[int], context: int, batch: int, decode: int, threads: int,
          repeats: int) -> dict:
    from xllm.proto.engine.v1 import engine_pb2

    prompt = (ids * (context // len(ids) + 1))[:context]
    steps: dict[str, list[float]] = {v: [] for v in SPEED}
    for _ in range(repeats):
        for variant in SPEED:  # interleaved: load changes hit every variant alike
            eng = _engine(model, tokenizer, variant, threads, context + decode + 8, memory_gib=1.5)
            for b in range(batch):
                eng.add_request(engine_pb2.GenerateRequest(
                    request_id=f"s{b}", prompt_token_ids=[(b + 7) % 1000, *prompt[1:]],
                    sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True)))
            while eng.has_work():
                pure_decode = all(s.num_computed_tokens >= s.num_prompt_tokens for s in eng.scheduler.running) \
                    and not eng.scheduler.waiting
                t = time.perf_counter()
                eng.step()
                if pure_decode and eng.scheduler.running:
                    steps[variant].append(time.perf_counter() - t)
            eng.close()
    return {v: {"decode_step_ms": 1e3 * statistics.median(s), "tok_s_per_seq": 1 / statistics.median(s),
                "steps": len(s)} for v, s in steps.items()}


def kernel(threads: int, repeats: int = 30) -> dict:
    """Decode attention alone: ``decode_attention`` over bf16 KV against ``decode_attention_q`` over int8 / e4m3
    rows, SmolLM2's heads (9 query / 3 KV of 64), median of interleaved calls."""
    import torch

    from xllm.kernels import decode_attention
    from xllm.kernels.attention_quant import decode_attention_q
    from xllm.kernels.kv_quant import KVQuantFormat, encode_rows, row_bytes

    torch.set_num_threads(threads)
    heads, kv_heads, dim = 9, 3, 64
    out = {}
    for batch, ctx in ((1, 4096), (4, 4096), (1, 16384)):
        slots, lens = torch.arange(batch), torch.full((batch,), ctx)
        k, v = (torch.randn(batch, ctx, kv_heads, dim).to(torch.bfloat16) for _ in range(2))
        q = torch.randn(batch, heads, dim).to(torch.bfloat16)
        calls = {"bf16": functools.partial(decode_attention, q, k, v, slots, lens, 0.125)}
        for kind in ("int8", "fp8_e4m3"):
            f = KVQuantFormat(kind, kv_heads, dim, row_bytes(kv_heads, dim, 16))
            calls[kind] = functools.partial(decode_attention_q, q, encode_rows(k, f), encode_rows(v, f), slots, lens,
                                            0.125, f, f)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(repeats):
            for name, call in calls.items():
                t = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t)
        out[f"{batch}x{ctx}"] = {name: 1e6 * statistics.median(t) for name, t in times.items()}
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--greedy-len", type=int, default=32)
    p.add_argument("--context", type=int, default=3072)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--decode", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--kernel-only", action="store_true",
                   help="only the decode attention kernel: microseconds per call, bf16 vs quantized rows")
    p.add_argument("--out", default=None, help="write the results as JSON here too")


def run(args: argparse.Namespace, output: Output) -> int:
    if args.kernel_only:
        print(json.dumps(kernel(args.threads), indent=1))
        return 0

    import torch

    from xllm.models import Tokenizer, load_model, resolve_model

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(None, progress=False)
    model, tokenizer = load_model(model_dir, torch.bfloat16, progress=False), Tokenizer(model_dir)
    ids = tokenizer.encode(TEXT.read_text())
    results: dict = {"text": TEXT.name, "tokens": len(ids), "threads": args.threads}
    if not args.skip_quality:
        step = max(1, (len(ids) - args.prompt_len) // args.prompts)
        prompts = [ids[i * step:i * step + args.prompt_len] for i in range(args.prompts)]
        results["quality"] = quality(model, tokenizer, ids, prompts, args.greedy_len, args.threads)
        print(json.dumps(results["quality"], indent=1), flush=True)
    if not args.skip_speed:
        results["speed"] = {"context": args.context, "batch": args.batch, **speed(
            model, tokenizer, ids, args.context, args.batch, args.decode, args.threads, args.repeats)}
        print(json.dumps(results["speed"], indent=1), flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


SCENARIO = Scenario("kv_quant", "quantized KV cache (int8, fp8_e4m3): quality, long-context decode, the kernel",
                    __doc__, add_arguments, run)
