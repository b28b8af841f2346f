"""Offline throughput of xllm.core.LLMEngine: all requests queued at once, ``while has_work(): step()``.

Usage: python xllm_offline.py JOB.json RESULT.json   (see benchmarks/workers/__init__.py for the format)
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import sys
import time


class _StepRecorder:
    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_step(self, s) -> None:
        self.steps.append({"seconds": s.step_time, "batch": s.batch_size, "prefill_tokens": s.num_prefill_tokens,
                           "decode_tokens": s.num_decode_tokens})


def _run(engine, prompts, output_lens, tag: str, bar=None) -> tuple[float, dict]:
    from xllm.proto.engine.v1 import engine_pb2

    t0 = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    for i, (ids, n) in enumerate(zip(prompts, output_lens)):
        sp = engine_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(engine_pb2.GenerateRequest(request_id=f"{tag}-{i}", prompt_token_ids=ids, sampling=sp,
                                                      arrival_time=time.time()))
    counts: dict[str, int] = {}
    admitted: dict[str, float] = {}
    while engine.has_work():
        t_step = time.perf_counter()
        chunks = engine.step()
        now = time.perf_counter()
        for seq in engine.scheduler.running:
            admitted.setdefault(seq.request_id, t_step)
        for c in chunks:
            admitted.setdefault(c.request_id, t_step)
            counts[c.request_id] = counts.get(c.request_id, 0) + len(c.token_ids)
            first.setdefault(c.request_id, now)
            if c.finish_reason:
                done[c.request_id] = (now, counts[c.request_id])
                if bar is not None:
                    bar.update(1)
    elapsed = time.perf_counter() - t0
    # times from the step that admitted the request into the running batch (queueing before it excluded)
    reqs = {rid: {"ttft": first[rid] - admitted[rid], "e2e": t - admitted[rid], "queued": admitted[rid] - t0,
                  "output_tokens": n} for rid, (t, n) in done.items()}
    return elapsed, reqs


def main(job_path: str, out_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    import torch

    from xllm.core import EngineConfig, LLMEngine
    from xllm.models import Tokenizer, load_model

    threads = int(job["threads"])
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    tokenizer = Tokenizer(job["model_dir"])
    dtype = getattr(torch, job["dtype"])
    model = load_model(job["model_dir"], dtype, progress=False)
    longest = max(len(p) + n for p, n in zip(job["prompts"], job["output_lens"]))
    cfg = EngineConfig(dtype=dtype, max_num_seqs=int(job["max_batch"]), num_threads=threads,
                       max_model_len=max(longest + 8, 256), kv_cache_memory_gib=float(job.get("kv_gib", 1.0)))
    recorder = _StepRecorder()
    engine = LLMEngine(model, tokenizer, cfg, observers=[recorder])
    load_s = time.perf_counter() - t0
    if job.get("warmup", True):
        _run(engine, [job["prompts"][0]], [min(8, job["output_lens"][0])], "warmup")
    recorder.steps.clear()
    bar = None
    if job.get("progress", True):
        with contextlib.suppress(ImportError):
            from tqdm import tqdm

            bar = tqdm(total=len(job["prompts"]), desc=job.get("desc", "xLLM offline"), unit="req", leave=False)
    elapsed, reqs = _run(engine, job["prompts"], job["output_lens"], "r", bar)
    if bar is not None:
        bar.close()
    versions = {}
    for dist in ("xllm-core", "xllm-models", "torch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    requests = [{"prompt_tokens": len(p), **reqs[f"r-{i}"]} for i, p in enumerate(job["prompts"])]
    with open(out_path, "w") as f:
        json.dump({"versions": versions, "load_s": load_s, "elapsed_s": elapsed, "requests": requests,
                   "steps": recorder.steps}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
