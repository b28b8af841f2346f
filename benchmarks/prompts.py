"""Exact-length prompts: token-id lists that every system sees identically.

Text is real English (docstrings of Python's standard library, the same on every machine with the same
Python). A prompt of N tokens is a window of N tokens of that text at a seeded random offset, kept only if
decoding it and encoding the text again gives back the same N ids, so a server that only accepts text
sees the very same tokens as one that takes ids.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import random
from dataclasses import dataclass

_MODULES = ("argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal", "difflib",
            "email", "fractions", "functools", "heapq", "inspect", "ipaddress", "itertools", "json", "logging",
            "mailbox", "pathlib", "pickle", "random", "shutil", "sqlite3", "statistics", "string",
            "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "zipfile")


def corpus_text(min_chars: int = 400_000) -> str:
    """Docstrings of stdlib modules and their public members, in a fixed order."""
    chunks: list[str] = []
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # pragma: no cover - stdlib
            continue
        for obj in [mod, *(getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_"))]:
            doc = inspect.getdoc(obj) if inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj) else None
            if doc and len(doc) > 200 and doc not in chunks:
                chunks.append(doc)
        if sum(map(len, chunks)) >= min_chars:
            break
    return "\n\n".join(chunks)


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    text: str


class PromptBank:
    """Draws exact-length prompts from the corpus with a given tokenizer (``tokenizer.json`` of a model dir)."""

    def __init__(self, model_dir: str | pathlib.Path) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(pathlib.Path(model_dir) / "tokenizer.json"))
        self.ids = self.tok.encode(corpus_text(), add_special_tokens=False).ids

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def prompt(self, n: int, rng: random.Random, tries: int = 200) -> Prompt:
        if not 1 <= n < len(self.ids):
            raise ValueError(f"prompt length must be in [1, {len(self.ids)}), got {n}")
        for _ in range(tries):
            start = rng.randrange(0, len(self.ids) - n)
            ids = self.ids[start:start + n]
            text = self.tok.decode(ids, skip_special_tokens=False)
            if self._encode(text) == ids:
                return Prompt(tuple(ids), text)
        raise RuntimeError(f"no round-trip-stable {n}-token window found in {tries} tries")

    def prompts(self, lengths: list[int], seed: int = 0) -> list[Prompt]:
        rng = random.Random(seed)
        return [self.prompt(n, rng) for n in lengths]


def customer_schema(records: int) -> dict:
    """A JSON schema (``structured``, ``grammar_cost``): a list of exactly ``records`` customers (nested
    objects, enums, integer bounds, patterns)."""
    customer = {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "address", "plan", "email"],
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                        "properties": {"city": {"type": "string", "maxLength": 16},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
            "plan": {"enum": ["free", "pro", "enterprise"]},
            "email": {"type": "string", "pattern": "^[a-z]{2,10}@[a-z]{2,10}\\.(com|org)$"},
        },
    }
    return {"type": "object", "additionalProperties": False, "required": ["customers"],
            "properties": {"customers": {"type": "array", "items": customer, "minItems": records,
                                         "maxItems": records}}}
