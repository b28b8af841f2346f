"""Shared request handling for chat and completions: fan-out to the engine,
stream merging, error mapping and usage accounting."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request

from xllm.core import EngineDeadError, EngineOverloadedError, InvalidRequestError
from xllm.gateway.engine_client import EngineClient
from xllm.gateway.openai.errors import APIError, bad_request, internal, model_not_found, overloaded
from xllm.gateway.registry import EmbeddedRegistry, NoInstanceError
from xllm.proto.engine.v1 import engine_pb2

FINISH_NAMES = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
    engine_pb2.FINISH_REASON_ERROR: "error",
}


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

    def add(self, chunk: engine_pb2.GenerateResponse) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason:
            self.finish_reason = FINISH_NAMES.get(chunk.finish_reason, "stop")
            self.completion_tokens = chunk.usage.completion_tokens
            self.cached_tokens = chunk.usage.cached_prompt_tokens


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Dispatcher:
    """Resolves the model, picks an instance and submits engine requests."""

    def __init__(self, registry: EmbeddedRegistry, default_model: str) -> None:
        self.registry = registry
        self.default_model = default_model
        self._cleanup: set[asyncio.Future] = set()  # keeps abort tasks alive until they ran

    def resolve_model(self, requested: str | None) -> str:
        served = self.registry.served_models()
        if requested is None or requested == "":
            return self.default_model
        if requested not in served:
            raise model_not_found(requested)
        return requested

    def submit_all(self, model: str, reqs: list[engine_pb2.GenerateRequest]) -> tuple[EngineClient, list]:
        """Submit every request to one instance (choices of a request stay together).
        On any failure the already submitted ones are aborted and an APIError raised."""
        try:
            client = self.registry.pick(model)
        except NoInstanceError as exc:
            raise APIError(503, str(exc), "server_unavailable") from exc
        streams = []
        try:
            for r in reqs:
                streams.append(client.submit(r))
        except BaseException as exc:
            for r in reqs[: len(streams)]:
                task = asyncio.ensure_future(client.abort(r.request_id))
                self._cleanup.add(task)
                task.add_done_callback(self._cleanup.discard)
            raise to_api_error(exc) from exc
        return client, streams


def to_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, EngineOverloadedError):
        return overloaded(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "server_unavailable")
    return internal(f"{type(exc).__name__}: {exc}")


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
                   model: str, priority: int) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
                                      model=model, priority=priority, arrival_time=time.time())


def sse(data: str) -> str:
    return f"data: {data}\n\n"


TokenText = Callable[[list[int]], list[str]]
