"""Offline throughput: a worker script runs N requests in one process of the system under test.

The job (token-id prompts, output lengths, batch limit, dtype, threads) goes to the worker as JSON; the
worker's result (per-request times, per-step times) comes back as JSON and is summarised here:
output tok/s, total tok/s, decode-step latency percentiles and decode tok/s.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import tempfile
from collections.abc import Sequence

from benchmarks.stats import RequestRecord, offline_summary, summarize


def run_worker(python: str, worker: pathlib.Path, job: dict, log_path: pathlib.Path) -> dict:
    """Run ``worker`` with ``python`` on ``job``; return its result (raises with the log's tail on failure)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="xbench-") as tmp:
        job_path, out_path = pathlib.Path(tmp) / "job.json", pathlib.Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        with open(log_path, "a") as log:
            # stderr is inherited so the worker's progress bar shows; stdout (library chatter) goes to the log
            res = subprocess.run([python, str(worker), str(job_path), str(out_path)], stdout=log, stderr=None)
        if res.returncode != 0 or not out_path.is_file():
            raise RuntimeError(f"{worker.name} failed with exit code {res.returncode}; log: {log_path}")
        return json.loads(out_path.read_text())


def summarize_worker(result: dict) -> dict:
    """Figures of an offline run from a worker's result."""
    reqs = result["requests"]
    steps = result["steps"]
    decode = [s for s in steps if s["prefill_tokens"] == 0 and s["decode_tokens"] > 0]
    prefill = [s for s in steps if s["prefill_tokens"] > 0]
    summary = offline_summary(sum(r["prompt_tokens"] for r in reqs), sum(r["output_tokens"] for r in reqs),
                              result["elapsed_s"], [s["seconds"] for s in decode], len(reqs))
    decode_time = sum(s["seconds"] for s in decode)
    summary["decode_steps"] = len(decode)
    summary["prefill_steps"] = len(prefill)
    summary["mean_decode_batch"] = (sum(s["decode_tokens"] for s in decode) / len(decode)) if decode else 0.0
    summary["decode_tok_s"] = sum(s["decode_tokens"] for s in decode) / decode_time if decode_time else 0.0
    summary["decode_tok_s_per_request"] = (len(decode) / decode_time) if decode_time else 0.0
    summary["prefill_step_ms"] = summarize([s["seconds"] for s in prefill], 1e3)
    summary["ttft_ms"] = summarize([r["ttft"] for r in reqs], 1e3)
    summary["e2e_ms"] = summarize([r["e2e"] for r in reqs], 1e3)
    summary["load_s"] = result.get("load_s")
    return summary


def records_of(result: dict) -> list[RequestRecord]:
    return [RequestRecord(prompt_tokens=r["prompt_tokens"], output_tokens=r["output_tokens"], ttft=r["ttft"],
                          e2e=r["e2e"]) for r in result["requests"]]


def job(model_dir: pathlib.Path, dtype: str, threads: int, prompts: Sequence[Sequence[int]],
        output_lens: Sequence[int], max_batch: int, desc: str, warmup: bool = True) -> dict:
    """A worker job; an empty ``desc`` turns the worker's progress bar off."""
    return {"model_dir": str(model_dir), "dtype": dtype, "threads": threads, "prompts": [list(p) for p in prompts],
            "output_lens": list(output_lens), "max_batch": max_batch, "warmup": warmup, "desc": desc,
            "progress": bool(desc)}
