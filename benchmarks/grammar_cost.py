"""The grammar's share of a decode step, in-process: ``python -m benchmarks grammar_cost [--threads N]``.

SmolLM2 (bf16) decodes ``--tokens`` greedy tokens for batch 1 and 16 under a JSON schema (a list of
customer records); the engine's mask computation (:meth:`xllm.core.grammar.Grammars._compute`:
catch-up, llguidance's masks, the additive mask's expansion) and the sampler's mask application
(:meth:`xllm.core.grammar.PendingMasks.apply`) are timed by wrapping them, against the median step.
What is on the critical path: the application, plus the computation unless it runs beside the forward
(``overlap``, decided by the engine). A direct measure of the overhead that survives a shared machine
(step times with and without a schema differ by more than the grammar's cost from run to run there).
Figures: ``docs/performance.md`` ("Structured outputs").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.scenario import Output, Scenario


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request (64)")
    p.add_argument("--batches", default="1,16", help="batch sizes (1,16)")


def run(args: argparse.Namespace, output: Output) -> int:
    import torch

    from benchmarks.prompts import customer_schema
    from xllm.core import EngineConfig, LLMEngine
    from xllm.core import grammar as g
    from xllm.engine.loader import load_grammars
    from xllm.models import Tokenizer, load_model, resolve_model
    from xllm.proto.engine.v1 import engine_pb2

    model_dir = resolve_model(progress=False)
    tok = Tokenizer(model_dir)
    model = load_model(model_dir, torch.bfloat16, progress=False)
    grammars = load_grammars(model_dir, tok, model.vocab_size)
    spent: dict[str, list[float]] = {"compute": [], "apply": []}
    compute, apply = g.Grammars._compute, g.PendingMasks.apply

    def timed_compute(self, work, pending):
        t0 = time.perf_counter()
        compute(self, work, pending)
        spent["compute"].append(time.perf_counter() - t0)

    def timed_apply(self, logits):
        t0 = time.perf_counter()
        out = apply(self, logits)
        spent["apply"].append(time.perf_counter() - t0)
        return out

    g.Grammars._compute, g.PendingMasks.apply = timed_compute, timed_apply
    engine = LLMEngine(model, tok, EngineConfig(dtype=torch.bfloat16, num_threads=args.threads,
                                                kv_cache_memory_gib=0.2, max_model_len=1024), grammars=grammars)
    prompt = tok.apply_chat_template([{"role": "user", "content": "List our customers as JSON."}])
    constraint = engine_pb2.StructuredOutput(json_schema=json.dumps(customer_schema(8)))

    def decode(batch: int, tokens: int) -> list[float]:
        for i in range(batch):
            sp = engine_pb2.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, structured=constraint)
            engine.add_request(engine_pb2.GenerateRequest(request_id=f"r{i}-{time.monotonic()}",
                                                          prompt_token_ids=prompt, sampling=sp))
        steps = []
        while engine.has_work():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        return steps[2:]  # decode steps

    print(f"threads {args.threads}, masks {'beside the forward' if grammars.overlap else 'before the forward'}")
    for batch in (int(b) for b in args.batches.split(",")):
        decode(batch, 4)  # warm-up
        spent["compute"].clear()
        spent["apply"].clear()
        step = statistics.median(decode(batch, args.tokens)) * 1e3
        masks = statistics.median(spent["compute"]) * 1e3
        applied = statistics.median(spent["apply"]) * 1e3
        critical = applied + (0.0 if grammars.overlap else masks)
        print(f"batch {batch}: step {step:.2f} ms, masks {masks:.3f} ms, apply {applied:.3f} ms: "
              f"{critical:.3f} ms on the critical path = {critical / step * 100:.1f} % of the step")
    engine.close()
    return 0



SCENARIO = Scenario("grammar_cost", "the grammar's share of real decode steps, in-process", __doc__, add_arguments,
                    run)
