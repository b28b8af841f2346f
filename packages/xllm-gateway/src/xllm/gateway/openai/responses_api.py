"""OpenAI's Responses API (``POST /v1/responses``) as a view of chat completions: the request schema, its
translation into a :class:`~xllm.gateway.openai.protocol.ChatCompletionRequest` (so templating, tool calls,
structured outputs, sampling and dispatch are the chat path's own), and the answer's items and events.

A request's ``input`` (a string, or items: messages with text content, ``function_call`` items a client
replays, ``function_call_output`` items answering them) plus ``instructions`` (a system message, not carried
over to a later response) and, with ``previous_response_id``, the stored conversation before it become the
chat messages; ``tools`` (function tools, the Responses shape) and ``tool_choice`` become chat tools;
``text.format`` (``text`` / ``json_object`` / ``json_schema``) the response format; ``max_output_tokens`` the
completion bound. Fields this server cannot honour are refused by name (``reasoning``, ``background``,
``truncation: auto``, non-text input items, ...), never ignored.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from xllm.gateway.openai.protocol import (
    Identifier,
    MaxTokens,
    ServiceTier,
    _refuse_set,
    _Strict,
)

# chat-request fields as a Responses request names them (the param of an error raised on the chat path)
CHAT_TO_RESPONSES_PARAM = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                           "max_tokens": "max_output_tokens", "response_format": "text.format"}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseTextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64)] | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @field_validator("name")
    @classmethod
    def _name_with_schema(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("type") != "json_schema":
            raise ValueError("only allowed with type 'json_schema'")
        return v


class ResponseText(_Strict):
    format: ResponseTextFormat | None = None
    verbosity: Any = None

    _refused = _refuse_set({"verbosity": "verbosity is not supported by this server"})


class ResponsesRequest(_Strict):
    """``POST /v1/responses`` (every field OpenAI defines: implemented, accepted when harmless, or refused)."""

    model: Identifier | None = None
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseText | None = None
    stream: bool = False
    previous_response_id: Annotated[str, Field(max_length=128)] | None = None
    store: bool = True
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    user: Identifier | None = None
    service_tier: ServiceTier | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    prompt_cache_key: Identifier | None = None
    safety_identifier: Identifier | None = None  # accepted, not used
    stream_options: dict[str, Any] | None = None
    reasoning: Any = None
    background: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    conversation: Any = None

    _refused = _refuse_set({
        "reasoning": "reasoning options are not supported by this server",
        "background": "background responses are not supported",
        "prompt": "prompt templates are not supported",
        "top_logprobs": "logprobs are not returned by /v1/responses here; use /v1/chat/completions",
        "max_tool_calls": "max_tool_calls is not supported",
        "conversation": "conversations are not supported; use previous_response_id",
    })

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, v: str | None) -> str | None:
        if v == "auto":
            raise ValueError("'auto' is not supported: a conversation longer than the context is refused")
        return v

    @field_validator("include")
    @classmethod
    def _nothing_included(cls, v: list[str] | None) -> list[str] | None:
        if v:
            raise ValueError(f"{v[0][:64]!r} cannot be included by this server")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: dict | None, info: ValidationInfo) -> dict | None:
        if v is not None and (not info.data.get("stream") or set(v) - {"include_obfuscation"}):
            raise ValueError("only {'include_obfuscation': ...} with stream (no obfuscation is ever added)")
        return v

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, v: list[dict] | None) -> list[dict] | None:
        for i, tool in enumerate(v or []):
            if tool.get("type") != "function" or not isinstance(tool.get("name"), str) or not tool["name"]:
                raise ValueError(f"tool {i} must be {{'type': 'function', 'name': ..., 'parameters': {{...}}}} "
                                 "(built-in tools are not available here)")
            if not isinstance(tool.get("parameters", {}), dict):
                raise ValueError(f"tool {i}: parameters must be a JSON schema object")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict | None, info: ValidationInfo) -> str | dict | None:
        if isinstance(v, dict):
            names = {t["name"] for t in info.data.get("tools") or []}
            if v.get("type") != "function" or v.get("name") not in names:
                raise ValueError("a named tool choice is {'type': 'function', 'name': <one of the tools>}")
        return v


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input`` (a 400 naming ``input[i]`` for an item it cannot take)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"input[{i}].role must be user, system, developer or assistant")
            where = f"input[{i}].content"
            content = item.get("content")
            out.append({"role": role, "content": _parts_of(content, where) if role == "user" and _has_image(content)
                        else _text_of(content, where)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                        "content": output if isinstance(output, str) else _text_of(output, f"input[{i}].output")})
        else:
            raise ValueError(f"input[{i}].type {str(kind)[:32]!r} is not supported (text messages, function_call "
                             "and function_call_output items only)")
    return out


def _string(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"input[{i}].{key} must be a string")
    return value


def _has_image(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image" for p in content)


def _parts_of(content: list, where: str) -> list[dict[str, Any]]:
    """A user message's text and ``input_image`` parts as chat content parts (``input_image``'s ``image_url``: a
    ``data:`` URL or an allowed ``http(s)`` URL, as chat's; ``file_id`` is refused: there is no files API)."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise ValueError(f"{where}[{j}].image_url must be the image's URL (a data: URL or an allowed http(s) "
                                 "URL; file_id is not supported)")
            image: dict[str, Any] = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": _text_of([part], f"{where}[{j}]")})
    return parts


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}[{j}] must be a text part ({{'type': 'input_text', 'text': ...}}); "
                                 "images only in user messages (input_image), files not at all")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where} must be a string or a list of text parts")


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request (as its JSON body) that serves ``req`` after ``history`` (the messages of
    the previous responses it continues)."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else [])
    messages += history + input_messages(req.input)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for key, value in (("max_completion_tokens", req.max_output_tokens), ("temperature", req.temperature),
                       ("top_p", req.top_p), ("parallel_tool_calls", req.parallel_tool_calls), ("user", req.user),
                       ("service_tier", req.service_tier), ("metadata", req.metadata),
                       ("prompt_cache_key", req.prompt_cache_key)):
        if value is not None:
            body[key] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                          "strict") if k in t}} for t in req.tools]
    if isinstance(req.tool_choice, dict):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice["name"]}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "response", "schema": fmt.schema_}
        schema.update({k: v for k, v in (("strict", fmt.strict), ("description", fmt.description)) if v is not None})
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    return body


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's assistant message as Responses output items (its text, then its tool calls)."""
    items: list[dict[str, Any]] = []
    if message.get("content"):
        items.append(message_item(new_item_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        items.append(function_call_item(new_item_id("fc"), call["id"], call["function"]["name"],
                                        call["function"]["arguments"], "completed"))
    return items


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def history_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat messages a later response sees (text, then the calls, one message)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def response_object(req: ResponsesRequest, response_id: str, model: str, created: float, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None, finish: str | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``response`` object (``status``: in_progress, completed, incomplete, failed)."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
        else {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": int(created), "status": status,
        "error": error, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "service_tier": req.service_tier or "default", "store": req.store, "temperature": req.temperature,
        "text": {"format": fmt}, "tool_choice": _tool_choice(req), "tools": req.tools or [], "top_p": req.top_p,
        "truncation": req.truncation or "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {},
    }


def _tool_choice(req: ResponsesRequest) -> Any:
    if req.tool_choice is not None:
        return req.tool_choice
    return "auto" if req.tools else "none"


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat completion's usage as the Responses API names it."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}

