"""Run inside the llama.cpp venv: a GGUF's prompt logprobs and greedy continuations, given token ids.

    python llamacpp_quality.py REQUEST.json RESULT.json

REQUEST: ``{"model": GGUF path, "threads": N, "n_ctx": C, "text": [ids] (scored: the logprob of every token
after the first), "greedy": [[ids], ...] (prompts), "max_tokens": n, "extra_bufts": bool (default true; false:
llamacpp_server.disable_extra_bufts, where ggml's AMX path dies)}``. RESULT: ``{"logprobs": [...],
"greedy": [[ids], ...], "seconds": {...}}``. The token ids are the caller's (the same vocabulary), so llama.cpp
scores and continues exactly the tokens the other systems see. Only the standard library, numpy and
llama_cpp (this venv's) are imported.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import numpy as np
from llama_cpp import Llama


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        req = json.load(f)
    if not req.get("extra_bufts", True):
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from llamacpp_server import disable_extra_bufts

        disable_extra_bufts()
    start = time.perf_counter()
    llm = Llama(model_path=req["model"], n_ctx=int(req["n_ctx"]), n_threads=int(req["threads"]),
                n_threads_batch=int(req["threads"]), n_batch=512, logits_all=True, verbose=False)
    loaded = time.perf_counter()
    ids = [int(t) for t in req["text"]]
    llm.reset()
    llm.eval(ids)
    rows = log_softmax(np.asarray(llm.scores[:len(ids) - 1]))
    logprobs = rows[np.arange(len(ids) - 1), ids[1:]].tolist()
    scored = time.perf_counter()
    greedy = []
    for prompt in req["greedy"]:
        llm.reset()
        llm.eval([int(t) for t in prompt])
        out = []
        for _ in range(int(req["max_tokens"])):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(tok)
            llm.eval([tok])
        greedy.append(out)
    done = time.perf_counter()
    with open(result_path, "w") as f:
        json.dump({"logprobs": logprobs, "greedy": greedy,
                   "seconds": {"load": loaded - start, "score": scored - loaded, "greedy": done - scored}}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
