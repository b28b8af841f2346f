"""Malformed and abusive OpenAI API requests, each with the 4xx it must get: the one case table
``integration_tests/reliability/test_hostile_clients.py`` and ``python -m benchmarks reliability``
both send (data only: no client, no assertions).

The expected answers hold for a gateway serving :data:`MODEL` with the limits of
:data:`SERVE_FLAGS` (a 20,000-character prompt limit, otherwise the defaults: ``--max-n 16``,
``--max-logprobs 20``, ``--max-prompts 64``) and without ``--allow-client-priority``: every case
is sent with a plain API key (or none), never a priority key. Each expects an OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` whose ``type`` and ``param`` are the case's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

MODEL = "tiny"
PROMPT_CHARS = 20_000
SERVE_FLAGS = ("--served-model-name", MODEL, "--max-prompt-chars", str(PROMPT_CHARS))
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]
S = "\ud800"  # a lone surrogate (sent as the JSON escape \ud800)
NAN, INF = math.nan, math.inf


@dataclass(frozen=True)
class HostileCase:
    """One request (``body``: a JSON object, or raw bytes sent as they are) and its expected answer."""

    name: str
    path: str
    body: dict | bytes
    param: str | None  # the error's ``param``: the field it names (None: not a request at all)
    status: int = 400
    type_: str = "invalid_request_error"

    def content(self) -> bytes:
        """The body as sent: raw bytes as they are, JSON with ASCII escapes (lone surrogates stay
        ``\\ud800``, NaN/Infinity as Python's JSON writes them)."""
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body, allow_nan=True).encode()


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


def with_literal(body: dict, field: str, literal: str) -> bytes:
    """``body`` with ``field`` set to a raw JSON literal (e.g. an overflowing number)."""
    return json.dumps({**body, field: "@@"}).replace('"@@"', literal).encode()


def _deep(levels: int) -> object:
    out: object = 1
    for _ in range(levels):
        out = [out]
    return out


DEEP = _deep(100)
case = HostileCase

CASES: tuple[HostileCase, ...] = (
    # lone surrogates: not valid Unicode (they used to reach the tokenizer and the response encoder: 500)
    case("surrogate-content", CHAT, chat(messages=[{"role": "user", "content": f"hi {S}"}]), "messages"),
    case("surrogate-content-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": S}]}]),
         "messages"),
    case("surrogate-message-name", CHAT, chat(messages=[{"role": "user", "content": "x", "name": S}]), "messages"),
    case("surrogate-model", CHAT, chat(model=S), "model"),
    case("surrogate-stop", CHAT, chat(stop=["ok", S]), "stop"),
    case("surrogate-stop-string", COMPLETIONS, completion(stop=S), "stop"),
    case("surrogate-logit-bias-key", CHAT, chat(logit_bias={f"5{S}": 1}), "logit_bias"),
    case("surrogate-user", CHAT, chat(user=S), "user"),
    case("surrogate-session-id", COMPLETIONS, completion(session_id=S), "session_id"),
    case("surrogate-tools", CHAT, chat(tools=[{"type": "function", "function": {"name": S}}]), "tools"),
    case("surrogate-metadata-key", CHAT, chat(metadata={S: "v"}), "metadata"),
    case("surrogate-prompt", COMPLETIONS, completion(prompt=f"a{S}b"), "prompt"),
    case("surrogate-prompt-list", COMPLETIONS, completion(prompt=["fine", S]), "prompt"),
    case("surrogate-raw-utf8-bytes", COMPLETIONS, b'{"prompt": "\xed\xa0\x80", "max_tokens": 1}', "prompt"),
    # non-finite numbers (Python's JSON reader takes NaN, Infinity and overflowing literals)
    case("nan-temperature", CHAT, chat(temperature=NAN), "temperature"),
    case("inf-repetition-penalty", CHAT, chat(repetition_penalty=INF), "repetition_penalty"),
    case("minus-inf-presence-penalty", COMPLETIONS, completion(presence_penalty=-INF), "presence_penalty"),
    case("nan-frequency-penalty", COMPLETIONS, completion(frequency_penalty=NAN), "frequency_penalty"),
    case("overflow-top-p", CHAT, with_literal(chat(), "top_p", "1e999"), "top_p"),
    case("nan-min-p", CHAT, chat(min_p=NAN), "min_p"),
    case("nan-logit-bias", CHAT, chat(logit_bias={"5": NAN}), "logit_bias"),
    case("nan-in-tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "x": NAN}}]), "tools"),
    case("huge-repetition-penalty", CHAT, chat(repetition_penalty=1e300), "repetition_penalty"),
    # unknown fields (OpenAI: "Unrecognized request argument supplied")
    case("unknown-field-chat", CHAT, chat(frobnicate=True), "frobnicate"),
    case("unknown-field-completions", COMPLETIONS, completion(guided_decoding_backend="x"), "guided_decoding_backend"),
    case("unknown-message-field", CHAT, chat(messages=[{"role": "user", "content": "x", "colour": "red"}]),
         "messages"),
    case("unknown-stream-option", CHAT, chat(stream=True, stream_options={"include_usage": True, "x": 1}),
         "stream_options"),
    case("chat-field-on-completions", COMPLETIONS, completion(messages=MSG), "messages"),
    # invalid output constraints and tool choices (checked before anything is submitted)
    case("response-format-json-schema-without-schema", CHAT,
         chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    case("response-format-invalid-schema", COMPLETIONS,
         completion(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
         "response_format"),
    case("guided-regex-invalid", CHAT, chat(guided_regex="a(b"), "guided_regex"),
    case("guided-grammar-invalid", COMPLETIONS, completion(guided_grammar="start: undefined_rule"), "guided_grammar"),
    case("tool-choice-required-without-tools", CHAT, chat(tool_choice="required"), "tool_choice"),
    case("tool-choice-named-unknown", CHAT, chat(tool_choice={"type": "function", "function": {"name": "f"}}),
         "tool_choice"),
    # OpenAI fields this server refuses (not silently ignored)
    case("functions", CHAT, chat(functions=[{"name": "f", "parameters": {}}]), "functions"),
    case("function-call", CHAT, chat(function_call="auto"), "function_call"),
    case("audio", CHAT, chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    case("modalities-audio", CHAT, chat(modalities=["text", "audio"]), "modalities"),
    case("prediction", CHAT, chat(prediction={"type": "content", "content": "x"}), "prediction"),
    case("reasoning-effort", CHAT, chat(reasoning_effort="high"), "reasoning_effort"),
    case("web-search", CHAT, chat(web_search_options={}), "web_search_options"),
    case("store-true", CHAT, chat(store=True), "store"),
    case("image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                                        "image_url": {"url": "x"}}]}]),
         "messages[0].content[0].image_url"),  # (a text model: no images)
    case("function-role", CHAT, chat(messages=[{"role": "function", "name": "f", "content": "x"}]), "messages"),
    case("suffix", COMPLETIONS, completion(suffix="!"), "suffix"),
    case("best-of-below-n", COMPLETIONS, completion(best_of=1, n=2), "best_of"),
    case("best-of-streamed", COMPLETIONS, completion(best_of=3, stream=True), "best_of"),
    # priority without permission (a plain API key)
    case("priority", CHAT, chat(priority=-10), "priority", 403, "permission_error"),
    case("service-tier-priority", CHAT, chat(service_tier="priority"), "service_tier", 403, "permission_error"),
    case("priority-on-completions", COMPLETIONS, completion(priority=-5), "priority", 403, "permission_error"),
    # limits
    case("n-above-limit", CHAT, chat(n=17), "n"),
    case("n-above-openai", COMPLETIONS, completion(n=1000), "n"),
    case("best-of-above-limit", COMPLETIONS, completion(best_of=17), "best_of"),  # fans out like n
    case("best-of-far-above-limit", COMPLETIONS, completion(best_of=160), "best_of"),
    case("top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    case("completion-logprobs-6", COMPLETIONS, completion(logprobs=6), "logprobs"),
    case("too-many-stops", CHAT, chat(stop=[str(i) for i in range(17)]), "stop"),
    case("stop-too-long", COMPLETIONS, completion(stop=["x" * 1000]), "stop"),
    case("too-many-stop-token-ids", CHAT, chat(stop_token_ids=list(range(1000))), "stop_token_ids"),
    case("logit-bias-too-large", CHAT, chat(logit_bias={str(i): 1 for i in range(1000)}), "logit_bias"),
    case("too-many-messages", CHAT, chat(messages=[{"role": "user", "content": "x"}] * 2000), "messages"),
    case("too-many-prompts", COMPLETIONS, completion(prompt=["x"] * 1000), "prompt"),
    case("prompt-chars-chat", CHAT, chat(messages=[{"role": "user", "content": "x" * (PROMPT_CHARS + 1)}]),
         "messages"),
    case("prompt-chars-completions", COMPLETIONS, completion(prompt=["x" * 15_000, "y" * 15_000]), "prompt"),
    case("tools-chars", CHAT, chat(tools=[{"type": "function", "function": {"description": "x" * PROMPT_CHARS}}]),
         "tools"),
    case("deep-nesting", CHAT, chat(tools=[{"type": "function", "function": {"parameters": DEEP}}]), "tools"),
    case("deeper-than-the-parser", CHAT, b"[" * 200_000 + b"]" * 200_000, None),
    case("model-name-too-long", CHAT, chat(model="m" * 10_000), "model"),
    case("session-id-too-long", CHAT, chat(session_id="s" * 1000), "session_id"),
    case("metadata-too-many-keys", CHAT, chat(metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
    # types and ranges
    case("temperature-string", CHAT, chat(temperature="0.5"), "temperature"),
    case("max-tokens-negative", COMPLETIONS, completion(max_tokens=-1), "max_tokens"),
    case("parallel-tool-calls-string", CHAT, chat(parallel_tool_calls="yes"), "parallel_tool_calls"),
    case("prompt-cache-retention", CHAT, chat(prompt_cache_retention="forever"), "prompt_cache_retention"),
    case("token-beyond-vocab", COMPLETIONS, completion(prompt=[10**9]), "prompt"),
    case("empty-prompt", COMPLETIONS, completion(prompt=""), "prompt"),
    case("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), "top_logprobs"),
    case("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), "stream_options"),
    # not a request at all
    case("invalid-utf8", CHAT, b'{"messages": "\xff"}', None),
    case("not-json", CHAT, b"{messages: hi}", None),
    case("json-array", COMPLETIONS, b"[1, 2]", None),
    case("empty-body", COMPLETIONS, b"", None),
    case("unknown-model", CHAT, chat(model="gpt-9"), "model", 404),
)
