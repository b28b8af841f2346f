"""The bounds of the OpenAI API, in one place: every limit a request is checked against, its default,
and the checks of the limits that depend on configuration.

Fixed rules of the OpenAI schema (types, ranges such as ``temperature`` in [0, 2]) live in
:mod:`xllm.gateway.openai.protocol`; what an operator may tune lives here, in :class:`ApiLimits`
(``xllm serve`` flags set the ones marked with a flag, :mod:`xllm.gateway.api_flags`). Every
limit is checked before the request costs anything (templating, tokenization, the engine), and a
request past one gets HTTP 400 naming the field (413 for the body size, 503 with ``Retry-After``
for the in-flight bound).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from xllm.engine_api.bounds import (
    MAX_BEAM_WIDTH,
    MAX_LOGIT_BIAS,
    MAX_PROMPT_CHARS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)
from xllm.gateway.openai.errors import bad_request
from xllm.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from xllm.gateway.openai.protocol_embeddings import EmbeddingRequest
from xllm.gateway.openai.protocol_recommend import RecommendRequest
from xllm.gateway.openai.protocol_tokenize import DetokenizeRequest, TokenizeRequest

MIB = 1024 * 1024

# OpenAI's own caps (the schema's ranges); a limit below can only lower them
OPENAI_MAX_N = 128
OPENAI_MAX_COMPLETION_LOGPROBS = 5


@dataclass(frozen=True)
class ApiLimits:
    """Limits of one gateway's OpenAI API (defaults sized for an 8k-128k context model).

    - ``max_body_bytes`` (``--max-body-mib``, 8 MiB): the HTTP request body, checked from
      ``Content-Length`` before reading and while reading a chunked body; 413.
    - ``max_json_depth`` (32): nesting of the JSON body (objects and arrays).
    - ``max_prompt_chars`` (``--max-prompt-chars``, 1,000,000): characters of the prompt before
      tokenization: message contents and names plus the tools' JSON (chat), the string prompts
      (completions). Bounds the templating and tokenization work one request can ask for.
    - ``max_messages`` (1024): messages of a chat request.
    - ``max_prompts`` (``--max-prompts``, 64): prompts in one completions request.
    - ``max_n`` (``--max-n``, 16): choices per prompt (OpenAI allows up to 128).
    - ``max_logprobs`` (``--max-logprobs``, 20, the engine's bound; 0 allowed): chat ``top_logprobs``
      and completions ``logprobs`` (which OpenAI caps at 5 anyway).
    - ``max_stop`` (16) stop strings of at most ``max_stop_chars`` (256) characters each;
      ``max_stop_token_ids`` (256) stop token ids; ``max_logit_bias`` (300) ``logit_bias`` entries.
      These defaults (and ``max_prompt_chars``, ``max_logprobs``) are defined once in
      :mod:`xllm.engine_api.bounds`, whose :class:`~xllm.engine_api.bounds.RequestBounds` the engine
      applies again to every request it receives.
    - ``max_inflight_requests`` (``--max-inflight-requests``, None: unlimited): generation requests
      (``POST /v1/...``) the gateway holds at once, streams included until they end; one more
      gets 503 with ``Retry-After``.
    """

    max_body_bytes: int = 8 * MIB
    max_json_depth: int = 32
    max_prompt_chars: int = MAX_PROMPT_CHARS
    max_messages: int = 1024
    max_prompts: int = 64
    max_n: int = 16
    max_logprobs: int = MAX_TOP_LOGPROBS
    max_stop: int = MAX_STOP
    max_stop_chars: int = MAX_STOP_CHARS
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    max_logit_bias: int = MAX_LOGIT_BIAS
    max_inflight_requests: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name == "max_logprobs" else 1
            if value is not None and (not isinstance(value, int) or value < low):
                raise ValueError(f"{f.name} must be an integer >= {low}, got {value!r}")
        if self.max_n > OPENAI_MAX_N:
            raise ValueError(f"max_n must be at most {OPENAI_MAX_N} (the OpenAI API's bound), got {self.max_n}")
        if self.max_logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(f"max_logprobs must be at most {MAX_TOP_LOGPROBS} (the engine's bound), "
                             f"got {self.max_logprobs}")


def check_limits(req: OpenAIRequest | RecommendRequest | TokenizeRequest | DetokenizeRequest,
                 limits: ApiLimits) -> None:
    """Raise a 400 :class:`~xllm.gateway.openai.errors.APIError` naming the first field of ``req``
    past one of ``limits`` (the body size and in-flight bounds are checked before parsing)."""
    if isinstance(req, RecommendRequest):
        _check_recommend(req, limits)
        return
    if isinstance(req, TokenizeRequest | DetokenizeRequest):
        _check_tokenize(req, limits)
        return
    if isinstance(req, EmbeddingRequest):
        inputs = req.inputs()
        _at_most("input", len(inputs), limits.max_prompts, "inputs")
        chars = sum(len(p) for p in inputs if isinstance(p, str))
        if chars > limits.max_prompt_chars:
            raise bad_request(f"input: {chars} characters; this server accepts at most {limits.max_prompt_chars}",
                              "input")
        return
    if not isinstance(req, ChatCompletionRequest | CompletionRequest):
        return  # (small fixed-shape bodies: the schema bounds them)
    _check_sampling(req, limits)
    if isinstance(req, ChatCompletionRequest):
        _check_chat(req, limits)
    elif isinstance(req, CompletionRequest):
        _check_completion(req, limits)


def _at_most(param: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise bad_request(f"{param}: {count} {what} requested; this server allows at most {limit}", param)


def _check_sampling(req: OpenAIRequest, limits: ApiLimits) -> None:
    _at_most("n", req.n, limits.max_n, "choices")
    stops = req.stop_list()
    _at_most("stop", len(stops), limits.max_stop, "stop sequences")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_chars:
        raise bad_request(f"stop: a stop sequence has {longest} characters; this server allows at most "
                          f"{limits.max_stop_chars}", "stop")
    _at_most("stop_token_ids", len(req.stop_token_ids or ()), limits.max_stop_token_ids, "stop token ids")
    _at_most("logit_bias", len(req.logit_bias or {}), limits.max_logit_bias, "logit_bias entries")
    if req.prompt_logprobs is not None:
        _at_most("prompt_logprobs", req.prompt_logprobs, limits.max_logprobs, "prompt logprobs")
    # an output constraint is compiled into a grammar: bounded like a prompt
    constraints = {"guided_json": req.guided_json, "guided_regex": req.guided_regex,
                   "guided_choice": req.guided_choice, "guided_grammar": req.guided_grammar,
                   "response_format": req.response_format.model_dump(by_alias=True) if req.response_format else None}
    for name, value in constraints.items():
        if value is None:
            continue
        size = len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False))
        if size > limits.max_prompt_chars:
            raise bad_request(f"{name}: the constraint holds {size} characters; this server accepts at most "
                              f"{limits.max_prompt_chars}", name)


def _check_chat(req: ChatCompletionRequest, limits: ApiLimits) -> None:
    _at_most("messages", len(req.messages), limits.max_messages, "messages")
    if req.logprobs:
        _at_most("top_logprobs", req.top_logprobs or 0, limits.max_logprobs, "top logprobs")
    chars = sum(len(m.text()) + len(m.name or "") for m in req.messages)
    if chars > limits.max_prompt_chars:
        raise bad_request(f"messages: the messages hold {chars} characters; this server accepts at most "
                          f"{limits.max_prompt_chars} before tokenization", "messages")
    if req.tools:
        chars += sum(len(json.dumps(t, ensure_ascii=False)) for t in req.tools)
        if chars > limits.max_prompt_chars:
            raise bad_request(f"tools: messages and tools hold {chars} characters; this server accepts at most "
                              f"{limits.max_prompt_chars} before tokenization", "tools")


def _check_recommend(req: RecommendRequest, limits: ApiLimits) -> None:
    if req.messages is not None:
        _at_most("messages", len(req.messages), limits.max_messages, "messages")
        chars = sum(len(m.text()) for m in req.messages)
    else:
        chars = len(req.prompt) if isinstance(req.prompt, str) else 0
    if chars > limits.max_prompt_chars:
        raise bad_request(f"prompt: {chars} characters; this server accepts at most {limits.max_prompt_chars} "
                          "before tokenization", "prompt" if req.messages is None else "messages")


def _check_completion(req: CompletionRequest, limits: ApiLimits) -> None:
    prompts = req.prompts()
    _at_most("prompt", len(prompts), limits.max_prompts, "prompts")
    # with beam search best_of is the beam width, bounded by the engine (xllm.core.beam), not choices
    _at_most("best_of", req.best_of or 1, MAX_BEAM_WIDTH if req.use_beam_search else limits.max_n, "choices")
    if req.logprobs is not None:
        _at_most("logprobs", req.logprobs, min(limits.max_logprobs, OPENAI_MAX_COMPLETION_LOGPROBS), "logprobs")
    chars = sum(len(p) for p in prompts if isinstance(p, str))
    if chars > limits.max_prompt_chars:
        raise bad_request(f"prompt: the prompts hold {chars} characters; this server accepts at most "
                          f"{limits.max_prompt_chars} before tokenization", "prompt")


def _check_tokenize(req: TokenizeRequest | DetokenizeRequest, limits: ApiLimits) -> None:
    """The text to tokenize within ``max_prompt_chars`` (messages also ``max_messages``); the tokens to
    detokenize too (one character at least per token)."""
    if isinstance(req, DetokenizeRequest):
        _at_most("tokens", len(req.tokens), limits.max_prompt_chars, "tokens")
        return
    if req.messages is not None:
        _at_most("messages", len(req.messages), limits.max_messages, "messages")
    chars = len(req.prompt) if req.prompt is not None else sum(len(m.text()) for m in req.messages)
    chars += sum(len(json.dumps(t, ensure_ascii=False)) for t in req.tools or ())
    if chars > limits.max_prompt_chars:
        field = "prompt" if req.prompt is not None else "messages"
        raise bad_request(f"{field}: {chars} characters; this server accepts at most {limits.max_prompt_chars}", field)
