"""Quality of quantized weights alone (the quality part of ``quant``; what is measured:
:mod:`benchmarks.quality`).

    python -m benchmarks perplexity                         # every xLLM format + llama.cpp on the GGUF files
    python -m benchmarks perplexity --variants bf16,q4_1 --no-llamacpp
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from benchmarks import quality
from benchmarks.quality import VARIANTS
from benchmarks.scenario import Output, Scenario


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp (its venv builds for ~5 min once)")
    p.add_argument("--threads", type=int, default=2, help="threads (2)")
    p.add_argument("--prompts", type=int, default=8, help="greedy-agreement prompts (8)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per greedy prompt (64)")
    p.add_argument("--greedy-len", type=int, default=32, help="greedy tokens per prompt (32)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON here (default: print only)")


def run(args: argparse.Namespace, output: Output) -> int:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        print(f"python -m benchmarks perplexity: unknown variants {bad}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    q = quality.measure(variants, not args.no_llamacpp, args.threads, args.prompts, args.prompt_len, args.greedy_len)
    if args.out:
        args.out.write_text(json.dumps(q, indent=1))
    print(quality.markdown(q))
    return 0


SCENARIO = Scenario("perplexity", "quantized weights' perplexity and greedy agreement (quant's quality part)",
                    __doc__ + "\n" + (quality.__doc__ or ""), add_arguments, run)
