"""``/v1/responses``: OpenAI's Responses API over the chat path (:mod:`xllm.gateway.openai.responses_api`).

:meth:`ResponsesServing.parse` validates a request and turns it into the chat completion request that serves
it (off the event loop, on the preprocessor's threads); :meth:`ResponsesServing.create` runs that through
:class:`~xllm.gateway.openai.serving_chat.ChatServing` and answers in the Responses shape: a ``response``
object, or its streaming semantic events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ..., ``response.completed``),
translated chunk by chunk from the chat stream. Errors on the chat path name the Responses field
(``input``, ``max_output_tokens``, ``text.format``).

Past responses are kept for ``previous_response_id`` (unless ``store: false``) in a bounded store
(:class:`ResponseStore`: the newest ``capacity``, in this gateway's memory; another gateway of a cluster does
not see them), readable with ``GET /v1/responses/{id}`` and removed with ``DELETE``.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from xllm.gateway.openai.errors import APIError, bad_request
from xllm.gateway.openai.limits import ApiLimits, check_limits
from xllm.gateway.openai.preprocess import Preprocessor
from xllm.gateway.openai.protocol import ChatCompletionRequest, Scheduling
from xllm.gateway.openai.request_body import decode_json, read_body, validation_error
from xllm.gateway.openai.responses_api import (
    CHAT_TO_RESPONSES_PARAM,
    ResponsesRequest,
    chat_body,
    function_call_item,
    history_of,
    input_messages,
    message_item,
    new_item_id,
    output_items,
    response_object,
    usage_of,
)
from xllm.gateway.openai.serving import INSTANCE_HEADER
from xllm.gateway.openai.serving_chat import ChatServing

DEFAULT_STORE_CAPACITY = 1024


@dataclass
class StoredResponse:
    """A finished response as a later one continues it: the chat messages it saw (without its
    instructions), its output items, and the object ``GET`` returns."""

    messages: list[dict[str, Any]]
    output: list[dict[str, Any]]
    body: dict[str, Any]


@dataclass(frozen=True)
class ParsedResponse:
    """A validated request, the chat request that serves it, and the conversation it continues and adds
    (the messages a later response sees before its own output)."""

    request: ResponsesRequest
    chat: ChatCompletionRequest
    messages: list[dict[str, Any]]


class ResponseStore:
    """The newest ``capacity`` responses by id (thread-safe: parsing runs on the preprocessor's threads)."""

    def __init__(self, capacity: int = DEFAULT_STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None


def _remap(exc: APIError) -> APIError:
    """``exc`` with the chat field it names as the Responses request names it."""
    if exc.param:
        head, dot, rest = exc.param.partition(".")
        head = head.split("[")[0]
        if head in CHAT_TO_RESPONSES_PARAM:
            exc.param = CHAT_TO_RESPONSES_PARAM[head] + (dot + rest if dot and head != "response_format" else "")
    return exc


class ResponsesServing:
    """The Responses API over a :class:`ChatServing` (see the module docstring)."""

    def __init__(self, preprocessor: Preprocessor, limits: ApiLimits, store: ResponseStore | None = None) -> None:
        self.preprocessor = preprocessor
        self.limits = limits
        self.store = store or ResponseStore()

    async def parse(self, raw: Request) -> ParsedResponse:
        """The request and the chat request that serves it (a 400 naming the field otherwise)."""
        body = await read_body(raw, self.limits.max_body_bytes)
        return await self.preprocessor.run(self._parse, body)

    def _parse(self, body: bytes) -> ParsedResponse:
        data = decode_json(body, self.limits.max_json_depth)
        try:
            req = ResponsesRequest.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise bad_request(f"Previous response with id '{req.previous_response_id}' not found.",
                                  "previous_response_id", "previous_response_not_found")
            history = previous.messages + history_of(previous.output)
        try:
            chat_req = ChatCompletionRequest.model_validate(chat_body(req, history))
        except ValueError as exc:  # an input item it cannot take (named), or the chat schema's refusal
            if isinstance(exc, ValidationError):
                raise _remap(validation_error(exc.errors())) from None
            raise bad_request(str(exc), "input") from None
        try:
            check_limits(chat_req, self.limits)
        except APIError as exc:
            raise _remap(exc) from None
        return ParsedResponse(req, chat_req, history + input_messages(req.input))

    async def create(self, parsed: ParsedResponse, chat: ChatServing, raw: Request, scheduling: Scheduling):
        """Serve ``parsed`` (:meth:`parse`) through ``chat`` (its model's chat path); the answer in the
        Responses shape."""
        req, messages = parsed.request, parsed.messages
        try:
            answer = await chat.create(parsed.chat, raw, scheduling)
        except APIError as exc:
            raise _remap(exc) from None
        headers = {INSTANCE_HEADER: answer.headers.get(INSTANCE_HEADER, "")}
        response_id = new_item_id("resp")
        if not req.stream:
            chat = json.loads(answer.body)
            choice = chat["choices"][0]
            output = output_items(choice["message"])
            body = response_object(req, response_id, chat["model"], chat["created"],
                                   "incomplete" if choice["finish_reason"] == "length" else "completed", output,
                                   usage_of(chat["usage"]), choice["finish_reason"])
            self._keep(req, response_id, messages, output, body)
            return JSONResponse(body, headers=headers)
        events = _Events(req, response_id, parsed.chat.model or "", self, messages)
        return StreamingResponse(events.run(answer.body_iterator), media_type="text/event-stream", headers=headers)

    def _keep(self, req: ResponsesRequest, response_id: str, messages: list[dict], output: list[dict],
              body: dict) -> None:
        if req.store:
            self.store.put(response_id, StoredResponse(messages, output, body))

    def get(self, response_id: str) -> JSONResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error",
                           "response_id", "not_found")
        return JSONResponse(stored.body)

    def delete(self, response_id: str) -> JSONResponse:
        if not self.store.delete(response_id):
            raise APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error",
                           "response_id", "not_found")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


class _Events:
    """One streamed response: the chat stream's chunks as the Responses API's semantic events."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str, serving: ResponsesServing,
                 messages: list[dict]) -> None:
        self.req, self.response_id, self.model, self.serving, self.messages = req, response_id, model, serving, messages
        self.seq = 0
        self.created = time.time()
        self.text_item: dict | None = None   # {"id", "index", "text"}
        self.calls: dict[int, dict] = {}      # chat tool-call index -> {"id", "index", "call_id", "name", "arguments"}
        self.next_index = 0
        self.finish: str | None = None
        self.usage: dict | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _response(self, status: str, output: list[dict], error: dict | None = None) -> dict:
        return response_object(self.req, self.response_id, self.model, self.created, status, output,
                               usage_of(self.usage), self.finish, error)

    async def run(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._response("in_progress", []))
        yield self._event("response.in_progress", response=self._response("in_progress", []))
        error = None
        async for raw in chunks:
            for line in raw.splitlines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                self.model = chunk.get("model", self.model)
                if chunk.get("usage"):
                    self.usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    for event in self._delta(choice):
                        yield event
        if error is not None:
            yield self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
            yield self._event("response.failed", response=self._response(
                "failed", self._output("incomplete"), {"code": error.get("code") or "server_error",
                                                       "message": error.get("message", "")}))
            return
        for event in self._close_items():
            yield event
        output = self._output("completed")
        status = "incomplete" if self.finish == "length" else "completed"
        body = self._response(status, output)
        self.serving._keep(self.req, self.response_id, self.messages, output, body)
        yield self._event(f"response.{status}", response=body)

    def _delta(self, choice: dict) -> list[str]:
        out: list[str] = []
        delta = choice.get("delta") or {}
        if delta.get("content"):
            if self.text_item is None:
                self.text_item = {"id": new_item_id("msg"), "index": self._claim(), "text": ""}
                item = self.text_item
                out.append(self._event("response.output_item.added", output_index=item["index"],
                                       item=message_item(item["id"], None, "in_progress")))
                out.append(self._event("response.content_part.added", item_id=item["id"], output_index=item["index"],
                                       content_index=0, part=_text_part("")))
            self.text_item["text"] += delta["content"]
            out.append(self._event("response.output_text.delta", item_id=self.text_item["id"],
                                   output_index=self.text_item["index"], content_index=0, delta=delta["content"],
                                   logprobs=[]))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            entry = self.calls.get(call["index"])
            if entry is None:
                entry = self.calls[call["index"]] = {"id": new_item_id("fc"), "index": self._claim(),
                                                     "call_id": call.get("id", ""), "name": fn.get("name", ""),
                                                     "arguments": ""}
                out.append(self._event("response.output_item.added", output_index=entry["index"],
                                       item=function_call_item(entry["id"], entry["call_id"], entry["name"], "",
                                                               "in_progress")))
            if fn.get("arguments"):
                entry["arguments"] += fn["arguments"]
                out.append(self._event("response.function_call_arguments.delta", item_id=entry["id"],
                                       output_index=entry["index"], delta=fn["arguments"]))
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
        return out

    def _claim(self) -> int:
        self.next_index += 1
        return self.next_index - 1

    def _close_items(self) -> list[str]:
        out: list[str] = []
        t = self.text_item
        if t is not None:
            out.append(self._event("response.output_text.done", item_id=t["id"], output_index=t["index"],
                                   content_index=0, text=t["text"], logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=t["id"], output_index=t["index"],
                                   content_index=0, part=_text_part(t["text"])))
            out.append(self._event("response.output_item.done", output_index=t["index"],
                                   item=message_item(t["id"], t["text"], "completed")))
        for c in self.calls.values():
            out.append(self._event("response.function_call_arguments.done", item_id=c["id"], output_index=c["index"],
                                   name=c["name"], arguments=c["arguments"]))
            out.append(self._event("response.output_item.done", output_index=c["index"],
                                   item=function_call_item(c["id"], c["call_id"], c["name"], c["arguments"],
                                                           "completed")))
        return out

    def _output(self, status: str) -> list[dict]:
        items: list[tuple[int, dict]] = []
        if self.text_item is not None:
            items.append((self.text_item["index"], message_item(self.text_item["id"], self.text_item["text"], status)))
        items += [(c["index"], function_call_item(c["id"], c["call_id"], c["name"], c["arguments"], status))
                  for c in self.calls.values()]
        return [item for _, item in sorted(items, key=lambda x: x[0])]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
