"""Async streaming client for OpenAI-compatible ``/v1/completions`` (and, given the bodies, chat) endpoints.

Replays a list of :class:`RequestSpec` at their arrival offsets (optionally under a concurrency cap),
streams every response and records per request: time to first token, the gaps between streamed chunks
(inter-token latency), end-to-end latency and the completion token count (from ``usage`` when the
server sends it, else the number of non-empty chunks).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.stats import RequestRecord


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: tuple[int, ...]
    prompt_text: str
    output_len: int
    arrival: float = 0.0   # seconds after the run starts


@dataclass(frozen=True)
class EndpointProfile:
    """How to talk to one server: whether it takes token-id prompts, and extra body fields.

    ``extra_body`` and ``min_tokens`` make every system generate exactly ``max_tokens`` greedy tokens
    (``ignore_eos`` for xLLM and vLLM; ``min_tokens`` = ``max_tokens`` for llama.cpp).
    """

    token_ids: bool = True
    extra_body: dict = field(default_factory=lambda: {"ignore_eos": True})
    include_usage: bool = True
    min_tokens: bool = False      # send min_tokens = max_tokens (servers without ignore_eos)
    max_concurrency: int | None = None  # a server that breaks under concurrent streams gets at most this many


def request_body(model: str, spec: RequestSpec, profile: EndpointProfile) -> dict:
    body = {"model": model, "prompt": list(spec.prompt_ids) if profile.token_ids else spec.prompt_text,
            "max_tokens": spec.output_len, "temperature": 0.0, "stream": True}
    if profile.include_usage:
        body["stream_options"] = {"include_usage": True}
    if profile.min_tokens:
        body["min_tokens"] = spec.output_len
    body.update(profile.extra_body)
    return body


def parse_sse_line(line: str) -> dict | None:
    """The JSON payload of a ``data:`` line; None for other lines and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    return json.loads(payload)


def chunk_text(choice: dict) -> str | None:
    """A streamed choice's new text: a completion's ``text`` or a chat completion's ``delta.content``."""
    return choice.get("text") or (choice.get("delta") or {}).get("content")


async def send_one(client, url: str, model: str, spec: RequestSpec, profile: EndpointProfile,
                   t_run0: float, body: dict | None = None) -> RequestRecord:
    """Stream one request (``body``: another endpoint's body, e.g. a chat completion's, instead of the
    completion :func:`request_body` makes) and record what its client saw."""
    rec = RequestRecord(prompt_tokens=len(spec.prompt_ids))
    t0 = time.perf_counter()
    rec.start = t0 - t_run0
    last = None
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body or request_body(model, spec, profile)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {body[:200]}")
            async for line in resp.aiter_lines():
                event = parse_sse_line(line)
                if event is None:
                    continue
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                    if event["usage"].get("prompt_tokens"):
                        rec.prompt_tokens = event["usage"]["prompt_tokens"]
                if "error" in event:
                    raise RuntimeError(str(event["error"])[:200])
                choices = event.get("choices") or []
                if not choices or not chunk_text(choices[0]):
                    continue
                now = time.perf_counter()
                if last is None:
                    rec.ttft = now - t0
                else:
                    rec.itls.append(now - last)
                last = now
                chunks += 1
        rec.e2e = time.perf_counter() - t0
        rec.output_tokens = usage_tokens if usage_tokens is not None else chunks
        if rec.ttft is None:
            raise RuntimeError("the stream held no tokens")
    except Exception as exc:
        rec.success = False
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    return rec


@dataclass
class RoutedStream:
    """One streamed completion as the routing benchmarks read it: the instance that served it (the
    gateway's ``x-xllm-instance`` header), time to its first text, end to end (None if it failed), the
    last ``usage`` it sent, and the error if it failed."""

    instance: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    usage: dict = field(default_factory=dict)
    error: str = ""

    @property
    def cached_tokens(self) -> int:
        return self.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) if self.usage else 0


async def stream_routed(client, url: str, body: dict) -> RoutedStream:
    """POST ``body`` (a streamed ``/v1/completions`` request) to ``url`` and read it to the end."""
    res = RoutedStream()
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            res.instance = resp.headers.get("x-xllm-instance")
            async for line in resp.aiter_lines():
                event = parse_sse_line(line)
                if event is None:
                    continue
                if "error" in event:
                    raise RuntimeError(str(event["error"])[:200])
                if event.get("usage"):
                    res.usage = event["usage"]
                if res.ttft is None and any(c.get("text") for c in event.get("choices", [])):
                    res.ttft = time.perf_counter() - start
        res.e2e = time.perf_counter() - start
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    return res


async def run_requests(base_url: str, model: str, specs: Sequence[RequestSpec], profile: EndpointProfile,
                       max_concurrency: int | None = None, desc: str | None = None,
                       timeout: float = 1800.0, bodies: Sequence[dict] | None = None,
                       path: str = "/v1/completions") -> tuple[list[RequestRecord], float]:
    """Send ``specs`` at their arrival offsets (``bodies``: each one's own body for ``path``, e.g. chat
    completions with images); return the records (in spec order) and the run's duration."""
    import httpx

    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    url = base_url.rstrip("/") + path
    if bodies is not None and len(bodies) != len(specs):
        raise ValueError(f"{len(bodies)} bodies for {len(specs)} requests")
    if profile.max_concurrency:
        max_concurrency = min(max_concurrency or profile.max_concurrency, profile.max_concurrency)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(specs), desc=desc, unit="req", leave=False) if (tqdm and desc) else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t_run0 = time.perf_counter()

        async def one(i: int, spec: RequestSpec) -> RequestRecord:
            body = bodies[i] if bodies is not None else None
            delay = t_run0 + spec.arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                rec = await send_one(client, url, model, spec, profile, t_run0, body)
            else:
                async with sem:
                    rec = await send_one(client, url, model, spec, profile, t_run0, body)
            if bar is not None:
                bar.update(1)
            return rec

        records = await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
        duration = time.perf_counter() - t_run0
    if bar is not None:
        bar.close()
    return list(records), duration


def served_model(base_url: str) -> str:
    """The first model id the server lists at ``/v1/models``."""
    import httpx

    resp = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def run(base_url: str, model: str, specs: Sequence[RequestSpec], profile: EndpointProfile,
        max_concurrency: int | None = None, desc: str | None = None) -> tuple[list[RequestRecord], float]:
    """Synchronous wrapper around :func:`run_requests`."""
    return asyncio.run(run_requests(base_url, model, specs, profile, max_concurrency, desc))
