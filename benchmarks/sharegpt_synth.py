"""A ShareGPT-like synthetic dataset made locally: no download, same file on every machine.

vLLM's benchmark client reads ShareGPT's format, a JSON list of
``{"id": ..., "conversations": [{"from": "human", "value": PROMPT}, {"from": "gpt", "value": RESPONSE}]}``,
takes the first turn as the prompt and the token count of the second as the request's output length.
This module writes such a file whose prompt and response token lengths follow lognormal distributions
shaped like ShareGPT's (long right tails: many short questions, a few long documents), clipped to
bounds, with text that is real English: exact-length windows of Python stdlib docstrings
(:class:`benchmarks.prompts.PromptBank`), each decoding and encoding back to the same token count.

Deterministic: the same seed, length specs and text source give the same file.
"""

from __future__ import annotations

import json
import math
import pathlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from benchmarks.prompts import Prompt


@dataclass(frozen=True)
class LogNormal:
    """Token lengths ``round(median * exp(sigma * N(0, 1)))`` clipped to ``[lo, hi]``."""

    median: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 1 <= self.lo <= self.hi):
            raise ValueError(f"bad lognormal length spec {self}")

    def sample(self, rng: random.Random) -> int:
        x = rng.lognormvariate(math.log(self.median), self.sigma)
        return max(self.lo, min(self.hi, round(x)))

    def describe(self) -> str:
        return f"lognormal(median {self.median:g}, sigma {self.sigma:g}) clipped to [{self.lo}, {self.hi}]"


# ShareGPT (the vicuna "unfiltered" V3 dump vLLM's docs use), first turns, as SmolLM2-style BPE tokens:
# prompts have a median of a few hundred characters with a heavy tail of pasted documents, responses a
# median near 150 tokens; sigma ~1 / ~0.8 reproduce that spread.
PROMPT_LENGTHS = LogNormal(median=180, sigma=1.0, lo=16, hi=1024)
OUTPUT_LENGTHS = LogNormal(median=150, sigma=0.8, lo=16, hi=512)


class TextSource(Protocol):
    """Gives text of exactly ``n`` tokens (e.g. :class:`benchmarks.prompts.PromptBank`)."""

    def prompt(self, n: int, rng: random.Random) -> Prompt: ...


def conversations(source: TextSource, n: int, seed: int = 0, prompt_lengths: LogNormal = PROMPT_LENGTHS,
                  output_lengths: LogNormal = OUTPUT_LENGTHS) -> list[dict]:
    """``n`` ShareGPT entries; the lengths are drawn first (one RNG), the text after (another), so the
    lengths depend only on the seed and the specs."""
    lengths_rng = random.Random(seed)
    lengths = [(prompt_lengths.sample(lengths_rng), output_lengths.sample(lengths_rng)) for _ in range(n)]
    text_rng = random.Random(seed + 1)
    out = []
    for i, (p_len, o_len) in enumerate(lengths):
        human = source.prompt(p_len, text_rng)
        gpt = source.prompt(o_len, text_rng)
        out.append({"id": f"synthetic-{seed}-{i}",
                    "conversations": [{"from": "human", "value": human.text}, {"from": "gpt", "value": gpt.text}],
                    "prompt_tokens": len(human.ids), "output_tokens": len(gpt.ids)})
    return out


def write(path: pathlib.Path, entries: Sequence[dict]) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(list(entries), indent=0, ensure_ascii=False))
    return path


def validate(entries: Sequence[dict]) -> list[str]:
    """Problems that would make vLLM's ShareGPT loader skip or misread an entry (empty when fine)."""
    problems = []
    for k, e in enumerate(entries):
        conv = e.get("conversations") if isinstance(e, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            problems.append(f"entry {k}: needs a 'conversations' list of at least 2 turns")
            continue
        roles = [t.get("from") for t in conv[:2]]
        if roles != ["human", "gpt"]:
            problems.append(f"entry {k}: turns are {roles}, expected ['human', 'gpt']")
        if not all(isinstance(t.get("value"), str) and t["value"] for t in conv[:2]):
            problems.append(f"entry {k}: empty or non-string 'value'")
    return problems


def length_summary(entries: Sequence[dict]) -> dict:
    """Median, p90, min and max of the prompt and output token counts the file was made with."""
    from benchmarks.stats import percentile

    out = {}
    for key in ("prompt_tokens", "output_tokens"):
        xs = [e[key] for e in entries]
        out[key] = {"n": len(xs), "median": percentile(xs, 50), "p90": percentile(xs, 90),
                    "min": min(xs) if xs else None, "max": max(xs) if xs else None,
                    "sum": sum(xs)}
    return out
