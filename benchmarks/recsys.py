"""Generative recommendation: wide beam search over 3-token items, xLLM vs vLLM-CPU vs HF ``generate``.

    python -m benchmarks recsys                               # widths 4,16,64,128 on SmolLM2; 512 on a tiny model
    python -m benchmarks recsys --widths 4,16 --requests 4 --systems xllm,hf   # minutes

Workload: a catalogue of ``--items`` (10^6) items, each 3 token ids drawn from three 256-id codebooks
(tokens 1000-1767 of SmolLM2's vocabulary), saved as ``.npy``; every request's prompt is a user's history
of 20 such items (60 tokens) after a short instruction. Requests run one at a time (``--requests`` per
width, after two warm-ups (one for vLLM)), each timed from submission to its answer; p50/p99 latency and requests/s
(= requests / their summed latency, one stream).

Systems (what each one does, exactly):

- ``xllm``: the engine in this process (``LLMEngine``, the model's dtype ``--dtype``), catalogue-constrained
  beam search (``item_catalog``): every step only the trie's allowed tokens are candidates, the ``W`` best
  items come back with their log-probabilities (what ``POST /v1/recommend`` serves);
- ``xllm-text``: the same engine, unconstrained text beam search of 3 tokens (``use_beam_search``,
  ``ignore_eos``): like for like with vLLM, which cannot constrain to a catalogue;
- ``vllm``: vLLM-CPU's ``LLM.beam_search`` (offline API; its OpenAI server runs the same loop): 3 tokens,
  ``ignore_eos``, one ``max_tokens=1`` generate call per beam per step with ``2W`` logprobs, outside the
  engine core (run in its venv, ``benchmarks/workers/recsys_vllm.py``);
- ``hf``: ``generate(num_beams=W, num_return_sequences=W, max_new_tokens=3)`` unconstrained (fp32 or the
  dtype given), its KV cache copied per beam.

The tiny model (W=512): 2 layers, hidden 256, 4 heads of 64 (vLLM-CPU has no attention kernel for
heads of 16), SmolLM2's vocabulary and tokenizer, random weights.

Results in ``--out`` (default ``benchmarks/results/recsys-<timestamp>``): ``results.json``, ``summary.md``
and ``recsys.png`` (req/s by width per system). The issue's goal: xllm >= 5x vLLM-CPU's req/s at W >= 16.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from benchmarks.report import add_output_args
from benchmarks.scenario import Output, Scenario

HERE = pathlib.Path(__file__).resolve().parent
SYSTEMS = ("xllm", "xllm-text", "vllm", "hf")
CODEBOOK = 256
TOKEN_BASE = 1000  # item token d of an item is TOKEN_BASE + d * CODEBOOK + code (distinct ids per level)
HISTORY = 20


def make_catalogue(path: pathlib.Path, items: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, CODEBOOK, size=(items, 3))
    arr = (TOKEN_BASE + np.arange(3) * CODEBOOK + codes).astype(np.int32)
    np.save(path, arr)
    return arr


def make_prompts(tokenizer, catalogue: np.ndarray, count: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    head = tokenizer.encode("Recommend the next item for this user. History:")
    return [head + catalogue[rng.integers(0, len(catalogue), HISTORY)].reshape(-1).tolist() for _ in range(count)]


def _summary(latencies: list[float]) -> dict:
    lat = np.asarray(latencies)
    return {"requests": len(lat), "p50_s": float(np.percentile(lat, 50)), "p99_s": float(np.percentile(lat, 99)),
            "req_per_s": float(len(lat) / lat.sum())}


def run_xllm(model_dir: pathlib.Path, catalogue: pathlib.Path | None, widths: list[int], prompts: list[list[int]],
             dtype: str, threads: int, text: bool) -> dict:
    import torch

    from xllm.core import EngineConfig, LLMEngine
    from xllm.models import Tokenizer, load_model
    from xllm.proto.engine.v1 import engine_pb2

    torch.set_num_threads(threads)
    model = load_model(model_dir, getattr(torch, dtype), progress=False)
    engine = LLMEngine(model, Tokenizer(model_dir), EngineConfig(
        dtype=getattr(torch, dtype), max_model_len=512, max_num_seqs=8, num_threads=threads,
        kv_cache_memory_gib=0.5, item_catalog=None if text else str(catalogue)))
    out = {}
    for w in widths:
        lat = []
        for i, p in enumerate([prompts[0], prompts[0], *prompts]):  # the first two warm up
            sp = engine_pb2.SamplingParams(max_tokens=3, beam_width=w, ignore_eos=True, item_catalog=not text)
            t0 = time.perf_counter()
            engine.add_request(engine_pb2.GenerateRequest(request_id=f"{w}-{i}", prompt_token_ids=p, sampling=sp))
            final = None
            while engine.has_work():
                for c in engine.step():
                    final = c if c.finish_reason else final
            if i > 1:
                lat.append(time.perf_counter() - t0)
            assert final is not None and len(final.beams) >= 1
        out[str(w)] = {**_summary(lat), "scanned_per_step": engine.beams.counters.candidates_scanned
                       / max(engine.beams.counters.steps, 1)}
        print(f"  {'xllm-text' if text else 'xllm'} W={w}: {out[str(w)]}", flush=True)
    engine.close()
    return out


def run_hf(model_dir: pathlib.Path, widths: list[int], prompts: list[list[int]], dtype: str, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    out = {}
    for w in widths:
        lat = []
        for i, p in enumerate([prompts[0], prompts[0], *prompts]):  # the first two warm up
            ids = torch.tensor([p])
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=w, num_return_sequences=w,
                               max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=2,
                               temperature=None, top_p=None, top_k=None)
            if i > 1:
                lat.append(time.perf_counter() - t0)
        out[str(w)] = _summary(lat)
        print(f"  hf W={w}: {out[str(w)]}", flush=True)
    return out


def run_vllm(model_dir: pathlib.Path, widths: list[int], prompts: list[list[int]], dtype: str, threads: int,
             out_dir: pathlib.Path) -> dict:
    from benchmarks.peers import vllm

    job = out_dir / "vllm-job.json"
    result = out_dir / "vllm-result.json"
    job.write_text(json.dumps({"model_dir": str(model_dir), "widths": widths, "prompts": prompts, "dtype": dtype}))
    env = vllm.env(threads)
    proc = subprocess.run([str(vllm.venv().python), str(HERE / "workers" / "recsys_vllm.py"), str(job), str(result)],
                          env=env, capture_output=True, text=True, timeout=7200)
    (out_dir / "vllm.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(result.read_text())


def _tiny_model(out_dir: pathlib.Path) -> pathlib.Path:
    """A 2-layer random Llama with SmolLM2's vocabulary and tokenizer (hidden 256, 4 heads of 64, 2 KV
    heads: vLLM-CPU's attention has no kernel for smaller heads)."""
    import shutil

    from transformers import LlamaConfig

    from xllm.models import resolve_model
    from xllm.testing.models import TOKENIZER_FILES, save_random_hf_model

    path = out_dir / "tiny-llama"
    if not (path / "config.json").exists():
        cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
        save_random_hf_model(path, cfg)
        smollm2 = resolve_model(progress=False)
        for name in TOKENIZER_FILES:
            if (smollm2 / name).is_file():
                shutil.copy(smollm2 / name, path / name)
    return path


def markdown(results: dict) -> str:
    lines = ["# recsys: beam search over 3-token items", "",
             f"load before/after: {results.get('load')}", "",
             "| model | width | system | p50 s | p99 s | req/s | vs vllm |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for model, per_system in results["runs"].items():
        widths = sorted({int(w) for r in per_system.values() if "error" not in r for w in r})
        for w in widths:
            base = per_system.get("vllm", {}).get(str(w), {}).get("req_per_s")
            for system, r in per_system.items():
                row = r.get(str(w)) if "error" not in r else None
                if row is None:
                    continue
                ratio = f"{row['req_per_s'] / base:.1f}x" if base else "-"
                lines.append(f"| {model} | {w} | {system} | {row['p50_s']:.3f} | {row['p99_s']:.3f} | "
                             f"{row['req_per_s']:.2f} | {ratio} |")
        for system, r in per_system.items():
            if "error" in r:
                lines.append(f"\n{model} / {system} failed: `{r['error'][-300:]}`")
    return "\n".join(lines) + "\n"


def plot(results: dict, out_dir: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for model, per_system in results["runs"].items():
        for system, r in per_system.items():
            if "error" in r:
                continue
            ws = sorted(int(w) for w in r)
            ax.plot(ws, [r[str(w)]["req_per_s"] for w in ws], marker="o", label=f"{system} ({model})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("beam width")
    ax.set_ylabel("requests/s (one stream)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "recsys.png", dpi=120)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: " + ", ".join(SYSTEMS))
    p.add_argument("--widths", default="4,16,64,128", help="beam widths on SmolLM2-135M")
    p.add_argument("--tiny-widths", default="512", help="beam widths on the tiny 2-layer model ('' to skip)")
    p.add_argument("--items", type=int, default=1_000_000, help="catalogue size")
    p.add_argument("--requests", type=int, default=8, help="timed requests per width and system")
    p.add_argument("--dtype", default="bfloat16", help="model dtype for every system")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    add_output_args(p, "recsys", report=False)


def run(args: argparse.Namespace, output: Output) -> dict | int:
    from benchmarks.machine import cpu_busy_fraction
    from xllm.models import Tokenizer, resolve_model

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        print(f"unknown system(s) {bad}; choose from {SYSTEMS}", file=sys.stderr)
        return 2
    out_dir = output.open()
    cat_path = out_dir / "items.npy"
    t0 = time.perf_counter()
    catalogue = make_catalogue(cat_path, args.items)
    from xllm.recsys.catalog import ItemCatalog

    t1 = time.perf_counter()
    trie = ItemCatalog.load(cat_path)
    load_s = time.perf_counter() - t1
    smollm2 = resolve_model(progress=False)
    prompts = make_prompts(Tokenizer(smollm2), catalogue, args.requests)
    results = {"argv": sys.argv, "systems": systems, "items": args.items, "catalogue_load_s": load_s,
               "catalogue_mb": trie.nbytes / 1e6, "catalogue_build_s": t1 - t0, "dtype": args.dtype,
               "threads": args.threads, "load": [cpu_busy_fraction()], "runs": {}}
    models = [("smollm2", smollm2, [int(w) for w in args.widths.split(",") if w])]
    if args.tiny_widths:
        models.append(("tiny", _tiny_model(out_dir), [int(w) for w in args.tiny_widths.split(",") if w]))
    for name, model_dir, widths in models:
        per = results["runs"].setdefault(name, {})
        for system in systems:
            print(f"{name} / {system}", flush=True)
            try:
                if system in ("xllm", "xllm-text"):
                    per[system] = run_xllm(model_dir, cat_path, widths, prompts, args.dtype, args.threads,
                                           text=system == "xllm-text")
                elif system == "hf":
                    per[system] = run_hf(model_dir, widths, prompts, args.dtype, args.threads)
                else:
                    per[system] = run_vllm(model_dir, widths, prompts, args.dtype, args.threads, out_dir)
            except Exception as exc:  # a peer failing is a result, not a crash of the run
                per[system] = {"error": repr(exc)}
            output.save(results)
    results["load"].append(cpu_busy_fraction())
    return results


SCENARIO = Scenario("recsys", "beam search over a 10^6-item catalogue, xLLM vs vLLM-CPU vs HF",
                    __doc__.split("\n\n")[0], add_arguments, run, markdown, plot)
