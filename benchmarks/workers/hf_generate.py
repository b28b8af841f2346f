"""Offline throughput of Hugging Face ``generate``: static batches, left padding, greedy, no early EOS.

Usage: python hf_generate.py JOB.json RESULT.json   (see benchmarks/workers/__init__.py for the format)

Requests are cut into batches of ``max_batch`` in order; each batch generates the longest output length
in it (``min_new_tokens`` = ``max_new_tokens``, so EOS never stops a row early); a row only counts the
tokens it asked for. Step times come from a logits processor called once per generation step.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import sys
import time


def main(job_path: str, out_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    threads = int(job["threads"])
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    dtype = getattr(torch, job["dtype"])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=dtype).eval()
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    load_s = time.perf_counter() - t0

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(prompts: list[list[int]], new_tokens: int, clock: StepClock) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))

    prompts, lens, batch = job["prompts"], job["output_lens"], int(job["max_batch"])
    if job.get("warmup", True):
        generate(prompts[:1], min(8, lens[0]), StepClock())
    bar = None
    if job.get("progress", True):
        with contextlib.suppress(ImportError):
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc=job.get("desc", "HF generate"), unit="req", leave=False)
    requests: list[dict] = []
    steps: list[dict] = []
    start = time.perf_counter()
    for b in range(0, len(prompts), batch):
        chunk, chunk_lens = prompts[b:b + batch], lens[b:b + batch]
        clock = StepClock()
        tb = time.perf_counter()
        generate(chunk, max(chunk_lens), clock)
        te = time.perf_counter()
        marks = [tb, *clock.times]
        for k in range(1, len(marks)):
            steps.append({"seconds": marks[k] - marks[k - 1], "batch": len(chunk),
                          "prefill_tokens": sum(map(len, chunk)) if k == 1 else 0,
                          "decode_tokens": 0 if k == 1 else len(chunk)})
        for p, n in zip(chunk, chunk_lens):
            # generate() returns the whole batch at its end: that is every row's completion time
            # times from the start of the row's batch (queueing behind earlier batches excluded)
            requests.append({"prompt_tokens": len(p), "output_tokens": n, "ttft": clock.times[0] - tb,
                             "e2e": te - tb, "queued": tb - start})
        if bar is not None:
            bar.update(len(chunk))
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    versions = {d: importlib.metadata.version(d) for d in ("transformers", "torch")}
    with open(out_path, "w") as f:
        json.dump({"versions": versions, "load_s": load_s, "elapsed_s": elapsed, "requests": requests,
                   "steps": steps}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
