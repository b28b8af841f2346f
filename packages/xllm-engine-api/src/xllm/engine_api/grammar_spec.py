"""A request's output constraint (``StructuredOutput``) as an llguidance grammar; torch-free.

The gateway checks a constraint here before it submits (so a bad schema is a 400 naming its API
field, in cluster mode too) and the engine compiles the same text (:mod:`xllm.core.grammar`). Why
llguidance: ``docs/performance.md`` ("Structured outputs: choosing the grammar engine").

JSON is generated compactly (``", "`` and ``": "`` separators, no free whitespace): a small model
given free whitespace may pad forever instead of closing the object.
"""

from __future__ import annotations

import json

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from xllm.engine_api.errors import InvalidRequestError
from xllm.proto.engine.v1 import engine_pb2

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CHOICES = 1024


def _error(msg: engine_pb2.StructuredOutput, text: str) -> InvalidRequestError:
    return InvalidRequestError(text, msg.field or "structured")


def lark_string(text: str) -> str:
    """A Lark string literal matching ``text`` exactly."""
    return json.dumps(text, ensure_ascii=False)


def grammar_text(msg: engine_pb2.StructuredOutput) -> str:
    """The llguidance grammar of ``msg``; raises :class:`InvalidRequestError` naming ``msg.field``
    for what is malformed before compiling (non-JSON schema, empty choices)."""
    kind = msg.WhichOneof("constraint")
    if kind == "json_schema":
        try:
            schema = json.loads(msg.json_schema)
        except ValueError as exc:
            raise _error(msg, f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise _error(msg, "the JSON schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(msg.regex)
    if kind == "choice":
        values = list(msg.choice.values)
        if not values or len(values) > MAX_CHOICES or any(not v for v in values):
            raise _error(msg, f"choices must be 1 to {MAX_CHOICES} non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(lark_string(v) for v in values))
    if kind == "grammar":
        text = msg.grammar
        if "::=" in text:  # GBNF (llama.cpp / xgrammar EBNF)
            try:
                text = gbnf_to_lark(text)
            except Exception as exc:  # the converter raises assorted errors for bad input
                raise _error(msg, f"invalid GBNF grammar: {exc}") from None
        return llguidance.LLMatcher.grammar_from_lark(text)
    raise _error(msg, "the structured output names no constraint")


def check(msg: engine_pb2.StructuredOutput, tokenizer: llguidance.LLTokenizer | None = None) -> str:
    """Validate ``msg`` and return its grammar text; :class:`InvalidRequestError` naming
    ``msg.field`` with llguidance's message when the schema, regex or grammar is invalid."""
    text = grammar_text(msg)
    error = llguidance.LLMatcher.validate_grammar(text, tokenizer)
    if error:
        kind = msg.WhichOneof("constraint").replace("_", " ")
        raise _error(msg, f"invalid {kind}: {error.strip()[:500]}")
    return text
