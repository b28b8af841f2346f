"""Grammar engines compared on this CPU: ``python -m benchmarks grammar_engines``.

For each candidate (xgrammar, llguidance, outlines-core) and a few JSON schemas: the time to
compile the schema against SmolLM2's tokenizer (49,152 tokens), and the time to compute one token
mask, averaged over the tokens of a valid instance (mask, then accept the instance's next token, as
a sampler would). The engines that are not installed are skipped; to compare all three without
installing them into the project's environment::

    pip install --no-deps --target /tmp/grammars xgrammar apache-tvm-ffi llguidance outlines-core
    PYTHONPATH=/tmp/grammars python -m benchmarks grammar_engines

The numbers are in ``docs/performance.md`` ("Structured outputs: choosing the grammar engine").
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from collections.abc import Callable

from benchmarks.scenario import Output, Scenario
from xllm.common.paths import cache_dir

SCHEMAS: dict[str, tuple[dict, object]] = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
             {"name": "Alice Smith", "age": 42}),
    "nested": ({"type": "object", "additionalProperties": False, "required": ["user", "tags", "status"],
                "properties": {
                    "user": {"type": "object", "additionalProperties": False, "required": ["id", "email"],
                             "properties": {"id": {"type": "integer"},
                                            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                                            "score": {"type": "number"}}},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                    "status": {"enum": ["active", "inactive", "banned"]}}},
               {"user": {"id": 7, "email": "bob@example.com", "score": 3.5}, "tags": ["a", "bc"],
                "status": "active"}),
    "wide": ({"type": "object", "additionalProperties": False,
              "required": [f"field_{i}" for i in range(20)],
              "properties": {f"field_{i}": ({"type": "integer"} if i % 3 == 0 else
                                            {"type": "string"} if i % 3 == 1 else
                                            {"type": "array", "items": {"type": "number"}})
                             for i in range(20)}},
             {f"field_{i}": (i if i % 3 == 0 else f"v{i}" if i % 3 == 1 else [1.5, i]) for i in range(20)}),
}


class Engine:
    """One engine's adapter: ``compile(schema) -> grammar``, ``run(grammar, tokens) -> mask seconds``."""

    name = ""

    def compile(self, schema: dict) -> object:
        raise NotImplementedError

    def masks(self, grammar: object, tokens: list[int]) -> list[float]:
        raise NotImplementedError


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        import llguidance
        import llguidance.torch as lt

        self.llg, self.lt = llguidance, lt
        self.tok = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)

    def compile(self, schema: dict) -> object:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.llg.LLMatcher(self.tok, grammar)  # compiles the lexer eagerly
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def masks(self, grammar: object, tokens: list[int]) -> list[float]:
        matcher = self.llg.LLMatcher(self.tok, grammar)
        bitmask = self.lt.allocate_token_bitmask(1, self.tok.vocab_size)
        out = []
        for t in tokens:
            t0 = time.perf_counter()
            self.lt.fill_next_token_bitmask(matcher, bitmask, 0)
            out.append(time.perf_counter() - t0)
            if not matcher.consume_token(t):
                raise RuntimeError(matcher.get_error())
        return out


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, model_dir: pathlib.Path, vocab: int, eos: int) -> None:
        import transformers
        import xgrammar

        self.xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.vocab = vocab

    def compile(self, schema: dict) -> object:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def masks(self, grammar: object, tokens: list[int]) -> list[float]:
        matcher = self.xgr.GrammarMatcher(grammar)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab)
        out = []
        for t in tokens:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            out.append(time.perf_counter() - t0)
            if not matcher.accept_token(t):
                raise RuntimeError(f"xgrammar refused token {t}")
        return out


class OutlinesCore(Engine):
    name = "outlines-core"

    def __init__(self, vocab_tokens: dict[str, int], eos: int, vocab: int) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
        from outlines_core.kernels.torch import allocate_token_bitmask

        self.oc, self.to_regex = outlines_core, build_regex_from_schema
        decoder = {c: b for b, c in _bytes_to_unicode().items()}
        mapping: dict[bytes, list[int]] = {}
        for piece, tid in vocab_tokens.items():
            if tid == eos or not all(c in decoder for c in piece):
                continue
            mapping.setdefault(bytes(decoder[c] for c in piece), []).append(tid)
        self.vocabulary = outlines_core.Vocabulary(eos, mapping)
        self.bitmask = allocate_token_bitmask(vocab)

    def compile(self, schema: dict) -> object:
        return self.oc.Index(self.to_regex(json.dumps(schema)), self.vocabulary)

    def masks(self, grammar: object, tokens: list[int]) -> list[float]:
        guide = self.oc.Guide(grammar)
        out = []
        for t in tokens:
            t0 = time.perf_counter()
            guide.write_mask_into(self.bitmask.data_ptr(), self.bitmask.numel(), self.bitmask.element_size())
            out.append(time.perf_counter() - t0)
            if t != self.vocabulary.get_eos_token_id():
                guide.advance(t)
            elif not guide.is_finished():
                raise RuntimeError("outlines-core: EOS before the end")
        return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (byte -> the character standing for it in the vocabulary)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", type=pathlib.Path, default=cache_dir("models", "SmolLM2-135M-Instruct"),
                   help="a HF model directory with tokenizer.json (default: the converted SmolLM2)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each instance's masks (the median is kept)")


def run(args: argparse.Namespace, output: Output) -> int:
    from tokenizers import Tokenizer

    text = (args.model_dir / "tokenizer.json").read_text()
    tok = Tokenizer.from_str(text)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id("<|im_end|>") or 0
    makers: dict[str, Callable[[], Engine]] = {
        "llguidance": lambda: LLGuidance(text, eos),
        "xgrammar": lambda: XGrammar(args.model_dir, vocab, eos),
        "outlines-core": lambda: OutlinesCore(tok.get_vocab(with_added_tokens=False), eos, vocab),
    }
    print(f"vocabulary {vocab} tokens; per-token mask time = median over {args.repeat} runs of the mean per token")
    print(f"{'engine':<14} {'setup s':>8} " + " ".join(f"{n + ' compile ms':>20} {n + ' mask us':>16}"
                                                      for n in SCHEMAS))
    for name, make in makers.items():
        try:
            t0 = time.perf_counter()
            engine = make()
            setup = time.perf_counter() - t0
        except ImportError as exc:
            print(f"{name:<14} not installed ({exc})")
            continue
        cells = []
        for schema, instance in SCHEMAS.values():
            tokens = [*tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False).ids, eos]
            try:
                t0 = time.perf_counter()
                grammar = engine.compile(schema)
                compile_ms = (time.perf_counter() - t0) * 1e3
                runs = [statistics.mean(engine.masks(grammar, tokens)) for _ in range(args.repeat)]
                cells.append(f"{compile_ms:>20.1f} {statistics.median(runs) * 1e6:>16.0f}")
            except Exception as exc:  # one engine's failure is a result of the comparison
                cells.append(f"{'failed: ' + str(exc)[:30]:>37}")
        print(f"{name:<14} {setup:>8.2f} " + " ".join(cells))
    return 0



SCENARIO = Scenario("grammar_engines", "xgrammar vs llguidance vs outlines-core: compile and mask times", __doc__,
                    add_arguments, run)
