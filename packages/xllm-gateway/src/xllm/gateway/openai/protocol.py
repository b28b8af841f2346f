"""OpenAI request schemas: validated at the boundary, strict types, unknown fields refused.

Every field OpenAI defines for chat completions and (legacy) completions is declared here and is
either implemented, accepted because accepting it is harmless (``store: false``, ``metadata``,
``parallel_tool_calls``, ``response_format: {"type": "text"}``, ``tool_choice: "none"|"auto"``,
``service_tier: "auto"|"default"``, ...), or refused with a 400 naming it (``audio``,
``prediction``, JSON modes, forced tool calls, ...). The common vLLM extensions (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``priority``,
...) are accepted too. Any other field is refused ("Unrecognized request argument supplied: X",
as OpenAI answers), and so are non-finite numbers. ``docs/openai-api.md`` lists every field.

Limits an operator tunes (counts, lengths, the body size) are checked after validation, in
:mod:`xllm.gateway.openai.limits`; lone surrogates and the JSON body's depth before it, in
:mod:`xllm.gateway.openai.request_body`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from xllm.engine_api.bounds import MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS

StopField = str | list[str] | None

# Bounds of the engine message's integer fields (xllm.engine.v1.SamplingParams, GenerateRequest): larger
# values cannot be encoded, so they are rejected here as a 400 instead of failing later as a 500.
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
MaxTokens = Annotated[int, Field(ge=1, le=UINT32_MAX)]
Identifier = Annotated[str, Field(max_length=256)]  # model, user, session and cache keys


# service_tier -> engine priority (lower is served first); a negative one needs permission
SERVICE_TIER_PRIORITY = {"auto": 0, "default": 0, "flex": 1, "scale": -1, "priority": -1}
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]
# a request whose engine priority is at least this is offline (xllm serve --offline-priority)
DEFAULT_OFFLINE_PRIORITY = 1


@dataclass(frozen=True)
class Scheduling:
    """How the engine schedules a request (see :meth:`_SamplingFields.scheduling`)."""

    priority: int       # engine priority: lower is served first, 0 is the default
    offline: bool       # best-effort work in the capacity online requests leave (xllm.sched.colocation)
    service_tier: str   # what the response echoes: "flex" (offline), "priority"/"scale" (asked), "default"


# What the published JSON schema of a request (/openapi.json) says beyond the field types: these
# are checked by validators, which a JSON schema does not see.
_PROPERTY_NAMES = {"logit_bias": {"pattern": "^[0-9]{1,10}$"}}  # token ids (<= INT32_MAX, _bias_keys)


def _schema_notes(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The request's JSON schema as validated: a refused field (:func:`_refuse_set`) reads as
    null-only with its reason; ``logit_bias`` keys as token ids."""
    props = schema.get("properties", {})
    for deco in cls.__pydantic_decorators__.field_validators.values():
        for name, why in getattr(deco.func, "refusals", {}).items():
            if name in props:
                props[name] = {"type": "null", "default": None, "description": f"refused unless null: {why}"}
    for name, names in _PROPERTY_NAMES.items():
        for option in props.get(name, {}).get("anyOf", ()):
            if option.get("type") == "object":
                option["propertyNames"] = names


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, json_schema_extra=_schema_notes)


def _refuse_set(reasons: dict[str, str]):
    """A validator refusing any value but null for each field of ``reasons`` (field -> why)."""

    def check(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(reasons[info.field_name])
        return value

    check.refusals = reasons  # read by _schema_notes
    return field_validator(*reasons)(classmethod(check))


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk
    include_obfuscation: bool | None = None  # accepted; no obfuscation padding is ever added


class JSONSchemaFormat(_Strict):
    """``response_format.json_schema``: the output is JSON valid for ``schema`` (always enforced:
    ``strict`` true or false, the output is generated under the schema's grammar)."""

    name: Annotated[str, Field(max_length=64)]
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_with_its_type(cls, v: JSONSchemaFormat | None, info: ValidationInfo) -> JSONSchemaFormat | None:
        if v is not None and info.data.get("type") != "json_schema":
            raise ValueError("only allowed with type 'json_schema'")
        return v


class _SamplingFields(_Strict):
    """Fields shared by chat and completions."""

    model: Identifier | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1  # the server's bound: ApiLimits.max_n
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: StopField = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Identifier | None = None
    response_format: ResponseFormat | None = None
    service_tier: ServiceTier | None = None
    # vLLM-style extensions
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=MAX_REPETITION_PENALTY)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)] = 0
    # xLLM extension: requests of one chat session go to the instance that holds its KV cache
    session_id: Identifier | None = None
    # vLLM's guided decoding (xllm.gateway.openai.structured): at most one constraint per request
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # vLLM: logprobs of the prompt's tokens (teacher forced), with this many alternatives each
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # vLLM's beam search (xllm.core.beam; the width is best_of or n, see xllm.gateway.openai.beam)
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, v: StopField) -> StopField:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not (key.isascii() and key.isdigit() and int(key) <= INT32_MAX):
                raise ValueError(f"logit_bias keys must be token ids, got {key[:32]!r}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return v

    @field_validator("response_format")
    @classmethod
    def _schema_given(cls, v: ResponseFormat | None) -> ResponseFormat | None:
        if v is not None and v.type == "json_schema" and (v.json_schema is None or v.json_schema.schema_ is None):
            raise ValueError("type 'json_schema' needs json_schema.schema")
        return v

    def affinity_key(self) -> str | None:
        """The chat/session affinity hint for routing: ``session_id``, else ``user``."""
        return self.session_id or self.user or None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def requested_priority(self) -> tuple[str, int] | None:
        """The field asking to be served ahead of default requests and the engine priority it asks
        for (what needs permission); None when the request asks for default or lower priority (a
        downgrade, which anyone may ask for: ``service_tier: "flex"``, a positive ``priority``)."""
        priority = self.engine_priority()
        if priority >= 0:
            return None
        return ("priority" if self.priority else "service_tier"), priority

    def engine_priority(self) -> int:
        """The engine's priority for this request (lower is served first; 0 is the default):
        ``priority`` when nonzero (vLLM's semantics), else the ``service_tier``'s."""
        return self.priority or SERVICE_TIER_PRIORITY[self.service_tier or "auto"]

    def scheduling(self, offline_priority: int = DEFAULT_OFFLINE_PRIORITY) -> Scheduling:
        """The request's scheduling: its engine priority, and offline when it asks for
        ``service_tier: "flex"`` or its engine priority is at least ``offline_priority``."""
        priority = self.engine_priority()
        offline = self.service_tier == "flex" or priority >= offline_priority
        tier = "flex" if offline else (self.service_tier if self.service_tier in ("priority", "scale") else "default")
        return Scheduling(priority, offline, tier)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageUrl(_Strict):
    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(_Strict):
    """An image (a ``data:`` URL, or an ``http(s)`` URL of an allowed host: :mod:`xllm.gateway.media`)."""

    type: Literal["image_url"]
    image_url: ImageUrl | Annotated[str, Field(min_length=1)]  # (vLLM also takes the URL itself)


class ChatMessage(_Strict):
    """One message. Text content only; ``tool_calls`` / ``tool_call_id`` go to the chat template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImageUrlPart] | None = None
    name: Identifier | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant
    tool_call_id: Identifier | None = None  # tool
    refusal: str | None = None  # assistant: its text when content is null
    annotations: list[Any] | None = None  # assistant: accepted, not used
    audio: Any = None
    function_call: Any = None

    _refused = _refuse_set({"audio": "audio messages are not supported (text only)",
                            "function_call": "deprecated function calling is not supported; use tool_calls"})

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        """Named errors for content parts (a plain union error would only say 'not a string')."""
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image_url":
                    continue  # (its shape: ImageUrlPart's)
                if kind != "text":
                    raise ValueError(f"content part {i} has type {str(kind)[:32]!r}: only text and image_url parts "
                                     "are supported")
                if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                    raise ValueError(f"content part {i} must be {{'type': 'text', 'text': <string>}}")
        elif v is not None and not isinstance(v, str):
            raise ValueError("must be a string, a list of text and image_url parts or null")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if isinstance(p, TextPart))
        if self.content is None:
            return self.refusal or ""
        return self.content

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(p, ImageUrlPart) for p in self.content)

    def content_json(self) -> Any:
        """The content as JSON values (what :func:`xllm.gateway.media.parts.image_parts` reads)."""
        if isinstance(self.content, list):
            return [p.model_dump(exclude_none=True) for p in self.content]
        return self.content

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: the content a string, or with images the list of text and
        ``{"type": "image"}`` parts in order (as multimodal templates such as Qwen2-VL's render them)."""
        content: Any = self.text()
        if self.has_images():
            content = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                       for p in self.content]  # type: ignore[union-attr]
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name:
            msg["name"] = self.name
        if self.tool_calls is not None:
            msg["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class TextChatMessage(ChatMessage):
    """A message of text parts only (where images are not taken: recommendations)."""

    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    prompt_cache_key: Identifier | None = None  # routing affinity, as session_id
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # accepted; the prefix cache decides
    safety_identifier: Identifier | None = None  # accepted, not used
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    functions: Any = None
    function_call: Any = None
    add_generation_prompt: bool = True  # vLLM extension

    _refused = _refuse_set({
        "audio": "audio output is not supported (text only)",
        "prediction": "predicted outputs are not supported",
        "web_search_options": "web search is not supported",
        "reasoning_effort": "reasoning effort is not supported by this server",
        "verbosity": "verbosity is not supported by this server",
        "functions": "deprecated function calling is not supported; use tools",
        "function_call": "deprecated function calling is not supported; use tool_choice",
    })

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("requires logprobs to be true")
        return v

    @field_validator("tools")
    @classmethod
    def _tools_are_functions(cls, v: list[dict] | None) -> list[dict] | None:
        for i, tool in enumerate(v or []):
            fn = tool.get("function")
            if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not fn["name"]:
                raise ValueError(f"tool {i} must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
            if not isinstance(fn.get("parameters", {}), dict):
                raise ValueError(f"tool {i}: function.parameters must be a JSON schema object")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, v: str | dict | None, info: ValidationInfo) -> str | dict | None:
        tools = info.data.get("tools") or []
        if v == "required" and not tools:
            raise ValueError("'required' needs tools")
        if isinstance(v, dict):
            fn = v.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if v.get("type") != "function" or not isinstance(name, str):
                raise ValueError("a named tool choice is {'type': 'function', 'function': {'name': ...}}")
            if name not in {t["function"]["name"] for t in tools}:
                raise ValueError(f"names the function {name[:64]!r}, which is not among the tools")
        return v

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("true is not supported (this server keeps no completions)")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            raise ValueError("only the 'text' modality is supported")
        return v

    def affinity_key(self) -> str | None:
        """``session_id``, else ``prompt_cache_key``, else ``user``."""
        return self.session_id or self.prompt_cache_key or self.user or None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] | \
        Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    max_tokens: MaxTokens = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of_at_least_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v < info.data.get("n", 1):
            raise ValueError("must be at least n")
        if v is not None and v > 1 and info.data.get("stream"):
            raise ValueError("cannot be used with stream (the best choices are known only at the end)")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix needs a fill-in-the-middle template and the served models have none")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # one tokenized prompt
        return list(p)


OpenAIRequest = ChatCompletionRequest | CompletionRequest
