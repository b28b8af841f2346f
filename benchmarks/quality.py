"""Quality of quantized weights: perplexity of a held-out text and greedy agreement with the bf16 model
(the ``perplexity`` scenario, and the quality part of ``quant``; the weight variants and their files).

The text is ``benchmarks/data/romeo-and-juliet-3-1.txt`` (public domain, 6.3 KB, ~2,000 SmolLM2 tokens; see
``benchmarks/data/README.md``), never a benchmark prompt. Every system scores the same token ids:

- xLLM: one engine request per variant with ``prompt_logprobs`` (the engine's teacher-forced prompt logprobs,
  what ``/v1/completions`` returns for ``echo`` + ``logprobs``), ``max_tokens`` 1; perplexity =
  exp(mean NLL of every token after the first). The prompt runs as prefill chunks (512-token budget), i.e.
  the large-batch quantized GEMM (weights dequantized per panel, activations not rounded);
- llama.cpp (llama-cpp-python, ``benchmarks/workers/llamacpp_quality.py`` in its venv): ``eval`` of the same
  ids with ``logits_all``, on the very GGUF files xLLM loads (for Q4/Q8 weights its CPU GEMMs round the
  activations to 8 bits in every batch).

Greedy agreement: ``--prompts`` windows of ``--prompt-len`` tokens of the text, ``--greedy-len`` greedy tokens
each (the decode path: the skinny quantized GEMV, batched), compared with the bf16 model over the dequantized
Q4_1 weights (``--dtype bfloat16 --quantization none``): the share of prompts whose continuation is identical
and the mean share of tokens before the first difference.

Variants: ``bf16`` (dequantized), ``q4_1`` (the bundled GGUF as stored), ``q8_0`` / ``q4_0`` (GGUFs requantized
from it, :mod:`benchmarks.quant_files`), ``int8`` / ``int4`` / ``int4_g128`` / ``w8a8`` (``--quantization`` at load
from the dequantized weights; ``w8a8`` rounds activations to int8 per row as well). All with bfloat16
activations (what ``xllm serve`` runs).
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
TEXT = HERE / "data" / "romeo-and-juliet-3-1.txt"
GGUF_VARIANTS = {"q4_1": "Q4_1", "q8_0": "Q8_0", "q4_0": "Q4_0"}  # variant -> GGUF file type
LOAD_VARIANTS = {"bf16": "none", "int8": "int8", "int4": "int4", "int4_g128": "int4_g128",
                 "w8a8": "w8a8"}  # -> --quantization
VARIANTS = ("bf16", "q4_1", "q8_0", "q4_0", "int8", "int4", "int4_g128", "w8a8")
MAX_LEN = 4096


def gguf_files() -> dict[str, pathlib.Path]:
    """Variant -> the GGUF file it is served from (the bundled Q4_1 and its requantized Q8_0 / Q4_0)."""
    from benchmarks.peers.venv import cache_root
    from benchmarks.quant_files import requantized_gguf
    from xllm.models.source import bundled_gguf

    src = bundled_gguf()
    return {v: requantized_gguf(src, t, cache_root() / "gguf") for v, t in GGUF_VARIANTS.items()}


def load_variant(variant: str, files: dict[str, pathlib.Path], threads: int):
    """(model, tokenizer) of ``variant`` as ``xllm serve`` builds it (bfloat16 activations)."""
    import torch

    from xllm.models import Tokenizer, load_model, resolve_model

    torch.set_num_threads(threads)
    if variant in GGUF_VARIANTS:
        path = files[variant]
        model_dir = resolve_model(str(path), progress=False)
        return load_model(model_dir, torch.bfloat16, progress=False, gguf_file=path), Tokenizer(model_dir)
    model_dir = resolve_model(None, progress=False)
    return (load_model(model_dir, torch.bfloat16, progress=False, quantization=LOAD_VARIANTS[variant]),
            Tokenizer(model_dir))


def xllm_quality(model, tokenizer, ids: list[int], prompts: list[list[int]], n: int, threads: int) -> dict:
    """Prompt logprobs of ``ids`` and greedy continuations of ``prompts`` through one engine."""
    import torch

    from xllm.core import EngineConfig, LLMEngine
    from xllm.proto.engine.v1 import engine_pb2

    engine = LLMEngine(model, tokenizer, EngineConfig(dtype=torch.bfloat16, max_model_len=MAX_LEN,
                                                      num_threads=threads, kv_cache_memory_gib=0.5))
    out: dict[str, list] = {}
    lps: list[float] = []

    def run(requests: list[engine_pb2.GenerateRequest]) -> float:
        start = time.perf_counter()
        for r in requests:
            engine.add_request(r)
        while engine.has_work():
            for c in engine.step():
                out.setdefault(c.request_id, []).extend(c.token_ids)
                lps.extend(lp.logprob for lp in c.prompt_logprobs)
        return time.perf_counter() - start

    sp = engine_pb2.SamplingParams
    score_s = run([engine_pb2.GenerateRequest(request_id="text", prompt_token_ids=ids,
                                              sampling=sp(temperature=0, max_tokens=1, prompt_logprobs=0))])
    greedy_s = run([engine_pb2.GenerateRequest(request_id=f"g{i}", prompt_token_ids=p,
                                               sampling=sp(temperature=0, max_tokens=n, ignore_eos=True))
                    for i, p in enumerate(prompts)])
    engine.close()
    return {"logprobs": lps, "greedy": [out[f"g{i}"] for i in range(len(prompts))],
            "seconds": {"score": score_s, "greedy": greedy_s}}


def llamacpp_quality(path: pathlib.Path, ids: list[int], prompts: list[list[int]], n: int, threads: int) -> dict:
    """The same through llama-cpp-python on the GGUF at ``path`` (its venv, a worker process)."""
    from benchmarks.peers import llamacpp

    v = llamacpp.install()
    with tempfile.TemporaryDirectory() as tmp:
        req, res = pathlib.Path(tmp) / "request.json", pathlib.Path(tmp) / "result.json"
        req.write_text(json.dumps({"model": str(path), "threads": threads, "n_ctx": MAX_LEN, "text": ids,
                                   "greedy": prompts, "max_tokens": n,
                                   "extra_bufts": not llamacpp.amx_breaks_quantized()}))
        subprocess.run([str(v.python), str(HERE / "workers" / "llamacpp_quality.py"), str(req), str(res)],
                       check=True)
        return json.loads(res.read_text())


def summarize(raw: dict, reference: list[list[int]] | None) -> dict:
    """Perplexity, mean NLL and greedy agreement with ``reference`` (the bf16 continuations)."""
    lps = raw["logprobs"]
    nll = -sum(lps) / len(lps)
    out = {"tokens_scored": len(lps), "nll": nll, "perplexity": math.exp(nll), "seconds": raw.get("seconds")}
    if reference is not None:
        same, prefix = 0, 0.0
        for got, want in zip(raw["greedy"], reference):
            k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
            same += k == len(want)
            prefix += k / len(want)
        out["greedy_identical"] = same / len(reference)
        out["greedy_prefix_agreement"] = prefix / len(reference)
    return out


def measure(variants: list[str], llamacpp: bool, threads: int, prompts_n: int, prompt_len: int,
            greedy_len: int, log=print) -> dict:
    """The quality table: per xLLM variant and (``llamacpp``) per GGUF file under llama.cpp."""
    files = gguf_files()
    results: dict = {"text": TEXT.name, "threads": threads, "prompts": prompts_n, "prompt_len": prompt_len,
                     "greedy_len": greedy_len, "files": {v: str(p) for v, p in files.items()}, "xllm": {},
                     "llamacpp": {}}
    order = ["bf16", *[v for v in variants if v != "bf16"]]  # the reference first
    reference = None
    for variant in order:
        model, tokenizer = load_variant(variant, files, threads)
        if "ids" not in results:
            ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
            step = (len(ids) - prompt_len - greedy_len) // max(prompts_n, 1)
            prompts = [ids[i * step:i * step + prompt_len] for i in range(prompts_n)]
            results["ids"] = len(ids)
        raw = xllm_quality(model, tokenizer, ids, prompts, greedy_len, threads)
        if variant == "bf16":
            reference = raw["greedy"]
        if variant in variants:
            results["xllm"][variant] = summarize(raw, reference)
            log(f"[quality] xllm {variant}: perplexity {results['xllm'][variant]['perplexity']:.3f}, greedy "
                f"identical {results['xllm'][variant].get('greedy_identical', 1):.0%}")
        del model
    if llamacpp:
        for variant in [v for v in variants if v in GGUF_VARIANTS]:
            raw = llamacpp_quality(files[variant], ids, prompts, greedy_len, threads)
            results["llamacpp"][variant] = summarize(raw, reference)
            log(f"[quality] llama.cpp {variant}: perplexity {results['llamacpp'][variant]['perplexity']:.3f}, "
                f"greedy identical {results['llamacpp'][variant]['greedy_identical']:.0%}")
    return results


def markdown(q: dict) -> str:
    lines = [f"Perplexity of `{q['text']}` ({q['ids']} tokens, prompt logprobs of every token after the first); "
             f"greedy agreement with xLLM bf16 over the dequantized Q4_1 weights: {q['prompts']} prompts of "
             f"{q['prompt_len']} tokens of the text, {q['greedy_len']} greedy tokens each.", "",
             "| system | weights | perplexity | mean NLL | identical continuations | tokens before 1st difference |",
             "| --- | --- | --- | --- | --- | --- |"]
    for system in ("xllm", "llamacpp"):
        for variant, r in q.get(system, {}).items():
            lines.append(f"| {'xLLM' if system == 'xllm' else 'llama.cpp'} | {variant} | {r['perplexity']:.3f} | "
                         f"{r['nll']:.4f} | {r.get('greedy_identical', 1):.0%} | "
                         f"{r.get('greedy_prefix_agreement', 1):.0%} |")
    return "\n".join(lines) + "\n"
