"""The CPU work in front of the engine, off the event loop.

Parsing and validating a request body (up to the body limit of JSON), rendering the chat template
and tokenizing can each take long for a large request; on the event loop they would stall every
stream and ``/health`` meanwhile. :class:`Preprocessor` runs them on a small thread pool of its
own (the tokenizer is thread-safe, :class:`xllm.models.tokenizer.Tokenizer`), so the loop keeps
serving. A request whose client leaves while its work runs stops waiting for it; the work itself
finishes on its thread (it cannot be interrupted) and its result is dropped.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from xllm.gateway.openai.limits import ApiLimits
from xllm.gateway.openai.request_body import parse_request, read_body

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

DEFAULT_THREADS = 2


class Preprocessor:
    """Runs request parsing, templating and tokenization on its own threads (``close()`` at shutdown)."""

    def __init__(self, limits: ApiLimits, threads: int = DEFAULT_THREADS) -> None:
        self.limits = limits
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="xllm-preprocess")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a preprocessing thread, in a copy of the caller's context (as
        :func:`asyncio.to_thread`: the request id goes along); its exception is raised here."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def parse(self, request: Request, model: type[M]) -> M:
        """The request's body as a validated ``model`` within the limits (see
        :mod:`xllm.gateway.openai.request_body`); an ``APIError`` otherwise."""
        raw = await read_body(request, self.limits.max_body_bytes)
        return await self.run(parse_request, raw, model, self.limits)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
