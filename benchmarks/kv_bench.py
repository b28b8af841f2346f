"""KV memory benchmark (xLLM §4.3): xTensor vs the paged fallback vs contiguous preallocation.

Three measurements on the real SmolLM2 (bf16, the engine's own code paths):

1. **Physical KV bytes per live token** on a mixed-length workload run through the engine:
   at every step, bytes held for live sequences / tokens they hold. xTensor and paged hold
   pages; "contiguous" reserves a max-length region per running sequence (what a static
   max-length allocator must commit), computed for the same steps.
2. **Decode step time** at batch 1/8/32 and context 512/2048: sequences' KV is allocated
   (and filled with zeros, no prefill) directly through each backend, then decode steps are
   timed. xTensor runs the engine's default path (the fused native decode for <= 8
   sequences); both backends are also timed on the identical eager module path, where only
   the attention addressing differs ((slot, length) vs block table).
3. **TTFT with and without prefix-cache hits**: requests sharing a long system prompt, one
   after another, prefix cache on vs off.

    python -m benchmarks kv_bench [--out DIR] [--threads 2] [--quick]

Writes ``kv.json`` and ``kv.md``.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import torch

from benchmarks.scenario import Output, Scenario


def _engine(model, tok, **cfg):
    from xllm.core import EngineConfig, LLMEngine

    cfg.setdefault("dtype", torch.bfloat16)
    return LLMEngine(model, tok, EngineConfig(**cfg))


def _request(rid, prompt, max_tokens, ignore_eos=True):
    from xllm.proto.engine.v1 import engine_pb2

    return engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=engine_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos))


# ---- 1. bytes per live token --------------------------------------------------------------------
def memory_per_token(model, tok, threads: int, quick: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    n = 12 if quick else 32
    lens = torch.randint(16, 400 if quick else 1024, (n,), generator=g).tolist()
    outs = torch.randint(8, 64 if quick else 256, (n,), generator=g).tolist()
    prompts = [torch.randint(0, 49000, (p,), generator=g).tolist() for p in lens]
    out: dict = {"requests": n, "prompt_lens": lens, "output_lens": outs}
    for backend in ("xtensor", "paged"):
        eng = _engine(model, tok, kv_cache_backend=backend, num_threads=threads, max_num_seqs=16,
                      enable_prefix_cache=False, max_model_len=2048)
        for i, (p, o) in enumerate(zip(prompts, outs)):
            eng.add_request(_request(f"r{i}", p, o))
        per_step, contiguous = [], []
        per_token_bytes = eng.layout.spec.bytes_per_token(eng.layout.dtype)
        while eng.has_work():
            eng.step()
            live = sum(s.num_computed_tokens for s in eng.scheduler.running)
            if live:
                per_step.append(eng.kv.physical_bytes_in_use() / live)
                contiguous.append(len(eng.scheduler.running) * eng.max_model_len * per_token_bytes / live)
        out[backend] = {"bytes_per_live_token_mean": statistics.fmean(per_step), "block_size": eng.layout.block_size,
                        "ideal_bytes_per_token": per_token_bytes}
        out.setdefault("contiguous", {"bytes_per_live_token_mean": statistics.fmean(contiguous),
                                      "max_model_len": eng.max_model_len, "ideal_bytes_per_token": per_token_bytes})
        if backend == "xtensor":
            st = eng.kv.map_stats
            out[backend].update(maps=st.maps, map_seconds=st.map_seconds, reused_in_place=eng.kv.reused_in_place,
                                mean_map_us=1e6 * st.map_seconds / max(st.maps, 1))
        eng.close()
    return out


# ---- 2. decode step time ------------------------------------------------------------------------
def _filled(eng, batch: int, ctx: int) -> list:
    """``batch`` sequences whose first ``ctx - 1`` tokens are 'computed' (KV allocated, zeros)."""
    from xllm.core.sampling_params import SamplingParams
    from xllm.core.sequence import SeqStatus, Sequence

    seqs = []
    for b in range(batch):
        s = Sequence(f"s{b}", [int(t) for t in torch.randint(0, 49000, (ctx,))], SamplingParams(max_tokens=64), 0.0)
        if eng.kv.admit(s, ctx - 1) != ctx - 1:
            raise RuntimeError("KV pool too small for the decode benchmark")
        s.num_computed_tokens = ctx - 1
        s.status = SeqStatus.RUNNING
        seqs.append(s)
    for layer in range(eng.layout.spec.num_layers):
        for t in eng.kv.layer_kv(layer):
            if t is not None and not eng.kv.addressing.slot_views:
                t.zero_()
    return seqs


def _time_decode(eng, seqs, steps: int) -> float:
    """Median seconds per decode step over ``steps`` steps (KV writes go to the next position)."""
    times = []
    for _ in range(steps + 2):
        for s in seqs:
            if not eng.kv.allocate(s, 1):
                raise RuntimeError("KV pool exhausted")
        batch = eng.runner.prepare([(s, 1) for s in seqs])
        t = time.perf_counter()
        eng.runner.execute(batch)
        times.append(time.perf_counter() - t)
        for s in seqs:
            s.num_computed_tokens += 1
            s.prompt_ids.append(1)
    return statistics.median(times[2:])


def decode_times(model, tok, threads: int, quick: bool) -> list[dict]:
    rows = []
    batches, ctxs = ((1, 8), (512,)) if quick else ((1, 8, 32), (512, 2048))
    for ctx in ctxs:
        for batch in batches:
            row = {"batch": batch, "context": ctx}
            for backend, native, label in (("xtensor", True, "xtensor"), ("xtensor", False, "xtensor_eager"),
                                           ("paged", False, "paged")):
                eng = _engine(model, tok, kv_cache_backend=backend, native_decode=native, num_threads=threads,
                              max_num_seqs=max(batch, 1), max_model_len=ctx + 64, enable_prefix_cache=False,
                              kv_cache_memory_gib=3.0)
                seqs = _filled(eng, batch, ctx)
                row[label + "_ms"] = 1000 * _time_decode(eng, seqs, 3 if quick else 8)
                for s in seqs:
                    eng.kv.free(s)
                eng.close()
            rows.append(row)
            print(f"  decode batch {batch:2d} ctx {ctx:4d}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in row.items() if k.endswith("_ms")), flush=True)
    return rows


# ---- 3. TTFT with prefix hits -------------------------------------------------------------------
def prefix_ttft(model, tok, threads: int, quick: bool) -> dict:
    system = ("You are the support assistant of a large online hardware store. " * (20 if quick else 60)).strip()
    questions = ["Where are the hammers?", "Do you sell paint?", "I need wood screws.", "Any garden hoses?",
                 "What are your opening hours?", "Can I return a drill?", "Do you deliver?", "Is there parking?"]
    prompts = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    out = {"system_prompt_tokens": len(tok.encode(system)), "requests": len(prompts)}
    for cache in (False, True):
        eng = _engine(model, tok, num_threads=threads, enable_prefix_cache=cache)
        ttfts = []
        for i, p in enumerate(prompts):
            t = time.perf_counter()
            eng.add_request(_request(f"q{i}", p, 1))
            while eng.has_work():
                eng.step()
            ttfts.append(time.perf_counter() - t)
        later = ttfts[1:]  # the first request fills the cache in both runs
        out["prefix_cache_on" if cache else "prefix_cache_off"] = {
            "ttft_ms_mean_after_first": 1000 * statistics.fmean(later), "ttft_ms_first": 1000 * ttfts[0],
            "hit_tokens": eng.kv.prefix_stats.hits, "queried_tokens": eng.kv.prefix_stats.queries}
        eng.close()
    return out


def markdown(res: dict) -> str:
    m = res["memory"]
    lines = ["### Physical KV bytes per live token (mixed lengths, bf16; ideal = bytes of one token's K+V)", "",
             "| allocator | bytes / live token | x ideal |", "| --- | ---: | ---: |"]
    ideal = m["xtensor"]["ideal_bytes_per_token"]
    for key, label in (("xtensor", "xTensor (pages mapped on demand)"), ("paged", "paged (block table)"),
                       ("contiguous", f"contiguous max-length ({m['contiguous']['max_model_len']} tokens)")):
        v = m[key]["bytes_per_live_token_mean"]
        lines.append(f"| {label} | {v:,.0f} | {v / ideal:.2f} |")
    x = m["xtensor"]
    lines += ["", f"xTensor mapping: {x['maps']} mmap calls, mean {x['mean_map_us']:.1f} µs each, "
              f"{x['reused_in_place']} pages reused in place without mapping.", "",
              "### Decode step time (ms, median)", "",
              "| batch | context | xTensor (default: fused native <= 8) | xTensor eager | paged eager "
              "| paged / xTensor eager |",
              "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["decode"]:
        lines.append(f"| {r['batch']} | {r['context']} | {r['xtensor_ms']:.1f} | {r['xtensor_eager_ms']:.1f} | "
                     f"{r['paged_ms']:.1f} | {r['paged_ms'] / r['xtensor_eager_ms']:.2f} |")
    p = res["prefix"]
    on, off = p["prefix_cache_on"], p["prefix_cache_off"]
    lines += ["", f"### TTFT, shared system prompt of {p['system_prompt_tokens']} tokens, {p['requests']} requests "
              "in sequence", "", "| prefix cache | TTFT mean after the first (ms) | hit / queried tokens |",
              "| --- | ---: | ---: |",
              f"| off | {off['ttft_ms_mean_after_first']:.0f} | – |",
              f"| on | {on['ttft_ms_mean_after_first']:.0f} | {on['hit_tokens']} / {on['queried_tokens']} |",
              "", f"TTFT ratio off/on: {off['ttft_ms_mean_after_first'] / on['ttft_ms_mean_after_first']:.2f}x"]
    return "\n".join(lines) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=pathlib.Path, default=None, help="output directory")
    ap.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads")
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")


def run(args: argparse.Namespace, output: Output) -> dict:
    from benchmarks.machine import cpu_busy_fraction, machine_info
    from xllm.models import Tokenizer, load_model, resolve_model

    output.open()
    busy_before = cpu_busy_fraction()
    model_dir = resolve_model()
    tok = Tokenizer(model_dir)
    model = load_model(model_dir, torch.bfloat16, progress=False)
    torch.set_num_threads(args.threads)
    print("memory per live token ...", flush=True)
    res = {"machine": machine_info(), "cpu_busy_before": busy_before}
    res["memory"] = memory_per_token(model, tok, args.threads, args.quick)
    print("decode step times ...", flush=True)
    res["decode"] = decode_times(model, tok, args.threads, args.quick)
    print("prefix-cache TTFT ...", flush=True)
    res["prefix"] = prefix_ttft(model, tok, args.threads, args.quick)
    res["cpu_busy_after"] = cpu_busy_fraction()
    return res


SCENARIO = Scenario("kv_bench", "KV memory: xTensor vs paged vs contiguous; decode steps; prefix-cache TTFT", __doc__,
                    add_arguments, run, markdown, prefix="kv", files=("kv.json", "kv.md"))
