"""Shared request handling for chat and completions: stream merging, the SSE stream skeleton,
non-streaming collection and usage accounting."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request

from xllm.gateway.openai.errors import APIError, to_api_error
from xllm.gateway.openai.protocol import Scheduling
from xllm.proto.engine.v1 import engine_pb2
from xllm.proto.enums import finish_reason_name

INSTANCE_HEADER = "x-xllm-instance"  # response header naming the instance that took the request


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Choice:
    """Accumulated output of one choice (non-streaming)."""

    index: int
    prompt_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[engine_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[engine_pb2.TokenLogprob] = field(default_factory=list)  # prompt tokens 1..
    beams: list[engine_pb2.BeamHypothesis] = field(default_factory=list)  # beam search: best first

    def add(self, chunk: engine_pb2.GenerateResponse) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        self.beams.extend(chunk.beams)
        if chunk.finish_reason:
            self.finish_reason = finish_reason_name(chunk.finish_reason)
            self.completion_tokens = chunk.usage.completion_tokens
            self.cached_tokens = chunk.usage.cached_prompt_tokens


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


async def merge_streams(streams: list) -> AsyncIterator[tuple[int, engine_pb2.GenerateResponse]]:
    """Interleave several request streams as ``(choice_index, chunk)`` in arrival
    order. Closing the iterator (client gone) closes every stream, aborting them."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream) -> None:
        try:
            async for chunk in stream:
                await queue.put((i, chunk))
        except BaseException as exc:  # forward engine errors to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def collect(streams: list, prompt_tokens: list[int], request: Request) -> list[Choice]:
    """Run all streams to completion; abort them if the client disconnects first."""
    choices = [Choice(i, prompt_tokens[i]) for i in range(len(streams))]

    async def run() -> None:
        async for i, chunk in merge_streams(streams):
            choices[i].add(chunk)

    task = asyncio.ensure_future(run())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                break
            if await request.is_disconnected():
                raise APIError(499, "client disconnected", "client_closed_request")
        try:
            task.result()  # re-raises an engine error
        except APIError:
            raise
        except Exception as exc:  # e.g. the engine died: the same status as when submit fails
            raise to_api_error(exc) from exc
        return choices
    finally:
        if not task.done():
            task.cancel()  # closes the streams, which aborts the requests


def engine_request(request_id: str, prompt_ids: list[int], sampling: engine_pb2.SamplingParams,
                   model: str, scheduling: Scheduling) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
                                      model=model, priority=scheduling.priority, offline=scheduling.offline,
                                      arrival_time=time.time())


# Characters str.splitlines() (so httpx's aiter_lines and requests' iter_lines) breaks lines at, which
# JSON leaves unescaped: escaped in every event, so a client splitting that way never cuts one in two.
_LINE_BREAKS = {c: f"\\u{c:04x}" for c in (0x0B, 0x0C, 0x1C, 0x1D, 0x1E, 0x85, 0x2028, 0x2029)}
# JSON escapes every control character below U+0020, so of those only these can occur in JSON text
_NON_ASCII_BREAKS = ("\x85", "\u2028", "\u2029")
# one encoder for every event (json.dumps with options builds a new one per call)
_encode = json.JSONEncoder(ensure_ascii=False).encode


def sse(data: str, event_id: str | None = None) -> str:
    """One server-sent event carrying ``data`` (JSON text) on a single line, with an ``id:`` line
    when ``event_id`` is given (what a reconnecting client sends back as ``Last-Event-ID``)."""
    if not data.isascii() and any(c in data for c in _NON_ASCII_BREAKS):  # (str.translate: ~6 µs an event)
        data = data.translate(_LINE_BREAKS)
    if event_id is not None:
        return f"id: {event_id}\ndata: {data}\n\n"
    return f"data: {data}\n\n"


def wants_event_ids(headers: Mapping[str, str]) -> bool:
    """Whether a streaming request's events carry ``id:`` lines: when its ``Accept`` header names
    ``text/event-stream`` (browsers' ``EventSource`` and other SSE clients, which keep the last id and send
    it back as ``Last-Event-ID``). Clients that split events and parse each as ``data: <json>`` alone (vLLM's
    benchmark client, many scripts) break on an ``id:`` line, and OpenAI's servers send none."""
    return "text/event-stream" in headers.get("accept", "").lower()


def event_id(rid: str, tokens: list[int]) -> str:
    """The SSE event id of a streamed response's event: the response id, then for each choice the
    output tokens (its engine request ``{rid}-{i}``'s ``token_ids``) the events so far carried, e.g.
    ``chatcmpl-3f2a…/12`` or ``cmpl-9c1b…/12,9`` (n=2). Exactly what ``EngineService.Reattach`` needs
    to continue each choice after the last event a client received (``from_token``)."""
    return f"{rid}/{','.join(map(str, tokens))}"


class StreamFormat(Protocol):
    """What differs between the chat and the completion SSE streams (per request; keeps its counts)."""

    object: str  # the chunks' "object": "chat.completion.chunk" / "text_completion"

    def opening(self) -> list[dict]:
        """Choices to send before any engine output (chat: each choice's assistant role)."""
        ...

    def choice(self, index: int, out: engine_pb2.GenerateResponse, finish: str | None) -> dict | None:
        """The choice entry for one engine chunk of choice ``index`` (None: nothing to send)."""
        ...

    def chunk_usage(self, index: int) -> dict | None:
        """Usage to attach to each content chunk (vLLM's ``continuous_usage_stats``), or None."""
        ...

    def final_usage(self) -> dict:
        """The usage of the whole request (the last chunk with ``stream_options.include_usage``)."""
        ...


async def sse_stream(fmt: StreamFormat, rid: str, model: str, created: int, include_usage: bool,
                     streams: list, service_tier: str = "default",
                     received: list[int] | None = None, event_ids: bool = True) -> AsyncIterator[str]:
    """The SSE body of a streamed response: ``fmt``'s chunks in arrival order, an error event if
    an engine fails mid-stream, the usage chunk when asked for, then ``[DONE]``. Every chunk echoes
    the ``service_tier`` the request was served at, as OpenAI's do. With ``event_ids`` each chunk's event
    has an ``id:`` (:func:`event_id`: the response id and the output tokens of each choice so far; see
    :func:`wants_event_ids`).

    ``received`` (a resumed stream; ``streams`` then replay each choice from its start): the output
    tokens of each choice the client already has. Every chunk still goes through ``fmt`` (its state:
    usage, tool calls), but no event is sent for the opening nor for a choice's chunks up to and
    including the one that reaches its count: the client gets each character once."""
    tokens = [0] * len(streams)
    skipping = [False] * len(streams) if received is None else [n > 0 for n in received]

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": rid, "object": fmt.object, "created": created, "model": model, "choices": choices,
                "service_tier": service_tier}
        if include_usage:
            body["usage"] = usage
        return sse(_encode(body), event_id(rid, tokens) if event_ids else None)

    for choice in fmt.opening():
        if received is None:
            yield chunk([choice])
    try:
        async for i, out in merge_streams(streams):
            tokens[i] += len(out.token_ids)
            choice = fmt.choice(i, out, finish_reason_name(out.finish_reason))
            if skipping[i]:
                skipping[i] = tokens[i] < received[i]
            elif choice is not None:
                yield chunk([choice], fmt.chunk_usage(i))
    except Exception as exc:  # an engine failed mid-stream: tell the client, then end the stream
        yield sse(json.dumps(to_api_error(exc).body()))
    else:
        if include_usage:
            yield chunk([], fmt.final_usage())
    yield sse("[DONE]")
