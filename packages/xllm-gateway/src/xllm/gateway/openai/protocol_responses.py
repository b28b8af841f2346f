"""The shapes of the gateway's answers, as pydantic models: documentation only.

The routes build their bodies as plain dicts (:mod:`xllm.gateway.openai.serving_chat`, ...); these
models describe those dicts in ``/openapi.json`` (:mod:`xllm.gateway.openai.protocol_openapi`), so
that client generators and schema-driven fuzzers see the real answers. The API tests validate
every answer against them, so a new field in a body must be added here too. Unknown fields are
allowed (a client must ignore fields it does not know, as OpenAI's clients do).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Doc):
    message: str
    type: str = Field(description="e.g. invalid_request_error, authentication_error, permission_error, "
                                  "not_found_error, server_overloaded, server_unavailable, internal_error")
    param: str | None = Field(description="the top-level request field at fault, when one is")
    code: str | None = Field(description="e.g. model_not_found, context_length_exceeded, request_too_large, "
                                          "invalid_api_key, overloaded")


class ErrorResponse(_Doc):
    """Every 4xx and 5xx answer (and an error event in a stream)."""

    error: ErrorDetail


class PromptTokensDetails(_Doc):
    cached_tokens: int


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[TokenLogprob] | None


class CompletionLogprobs(_Doc):
    """The legacy completions format (``echo`` puts the prompt's tokens first, the first with nulls)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Doc):
    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # vLLM's: null for the first prompt token


class FunctionCall(_Doc):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(_Doc):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatCompletionMessage(_Doc):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(_Doc):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletion(_Doc):
    """``POST /v1/chat/completions`` without ``stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    service_tier: str | None = None


class ToolCallDelta(_Doc):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, Any] | None = None


class ChatCompletionDelta(_Doc):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatCompletionChunkChoice(_Doc):
    index: int
    delta: ChatCompletionDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Doc):
    """One ``data:`` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    service_tier: str | None = None
    usage: Usage | None = None


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    prompt_logprobs: PromptLogprobs | None = None


class Completion(_Doc):
    """``POST /v1/completions`` without ``stream``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    service_tier: str | None = None


class CompletionChunk(_Doc):
    """One ``data:`` event of a streamed completion (the choices carry text deltas)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    service_tier: str | None = None
    usage: Usage | None = None


class RecommendedItem(_Doc):
    rank: int
    item_id: int
    token_ids: list[int]
    logprob: float


class Recommendation(_Doc):
    """``POST /v1/recommend``: the best ``top_n`` catalogue items, best first."""

    id: str
    object: Literal["recommendation"]
    created: int
    model: str
    items: list[RecommendedItem]
    usage: Usage


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class InstanceHealth(_Doc):
    healthy: bool
    status: str
    role: str | None = None
    registered_role: str | None = None
    flip: dict[str, Any] | None = None


class Health(_Doc):
    """``GET /health``: 200 while any instance is healthy, else 503 with the same body."""

    status: Literal["ok", "unhealthy"]
    instances: dict[str, InstanceHealth]


class ResponseOutputItem(_Doc):
    """An output item of ``/v1/responses``: the assistant's ``message`` (``content``: ``output_text`` parts)
    or a ``function_call`` (``call_id``, ``name``, ``arguments``)."""

    type: Literal["message", "function_call"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseUsage(_Doc):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponseObject(_Doc):
    """``POST /v1/responses`` (and ``GET /v1/responses/{id}``): OpenAI's ``response`` object."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[ResponseOutputItem]
    usage: ResponseUsage | None
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None


class ResponseStreamEvent(_Doc):
    """One semantic event of a streamed response (``event: <type>`` then ``data: <this>``):
    ``response.created``, ``response.output_item.added``, ``response.output_text.delta``, ...,
    ``response.completed``."""

    type: str
    sequence_number: int


class ResponseDeleted(_Doc):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class EmbeddingData(_Doc):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32")


class EmbeddingList(_Doc):
    """``POST /v1/embeddings``."""

    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: dict[str, int]


class Tokenized(_Doc):
    """``POST /tokenize``."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Detokenized(_Doc):
    """``POST /detokenize``."""

    prompt: str


STREAM_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionChunk, CompletionChunk, ResponseStreamEvent)
