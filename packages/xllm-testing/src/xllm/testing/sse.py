"""Reading a server-sent-events body in tests."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field


def sse_events(text: str) -> list:
    """The ``data:`` payloads of an SSE body: parsed JSON, or the literal ``[DONE]``."""
    out = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out



@dataclass
class CompletionStream:
    """What one client saw of one ``/v1/completions`` request (streamed or not)."""

    status: int | None = None
    instance: str | None = None         # x-xllm-instance: where the request started
    retry_after: str | None = None
    error_body: dict | None = None      # the JSON body of a non-200 answer
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)  # top logprobs per token (with ``logprobs``)
    finish: list[str] = field(default_factory=list)
    errors: list = field(default_factory=list)  # error events inside the stream, recorded transport errors
    usage: dict | None = None
    done_at: float | None = None        # time.monotonic() when the answer ended

    def complete(self, max_tokens: int) -> bool:
        """A 200 that ended normally with ``max_tokens`` tokens and no error (``ignore_eos`` requests)."""
        return (self.status == 200 and not self.errors and self.finish == ["length"] and bool(self.text)
                and (self.usage is None or self.usage.get("completion_tokens") == max_tokens))


async def stream_completion(client, body: dict, first=None, out: CompletionStream | None = None,
                            record_http_errors: bool = False, read_chunks: int | None = None,
                            leave=None) -> CompletionStream:
    """POST a streaming ``/v1/completions`` ``body`` with ``client`` (an ``httpx.AsyncClient``) and
    read the answer into ``out`` (filled as the stream goes, for callers that look at it meanwhile).

    ``first`` (an ``asyncio.Event``) is set at the first choice chunk (and at the end);
    ``record_http_errors``: a failed connection is recorded in ``errors`` instead of raised;
    ``read_chunks``: after that many chunks, wait for ``leave`` (an ``asyncio.Event``, if given) and
    drop the connection (a client that disconnects mid-stream). A non-200 answer's JSON body goes
    to ``error_body``."""
    import httpx

    out = out if out is not None else CompletionStream()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            out.status, out.instance = resp.status_code, resp.headers.get("x-xllm-instance")
            out.retry_after = resp.headers.get("retry-after")
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    out.error_body = json.loads(raw)
                except ValueError:
                    out.errors.append(f"HTTP {resp.status_code}, not JSON: {raw[:200]!r}")
                return out
            chunks = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.errors.append(event["error"])
                    continue
                if event.get("usage"):
                    out.usage = event["usage"]
                for choice in event.get("choices", []):
                    out.text += choice.get("text") or ""
                    if choice.get("logprobs"):
                        out.tokens += choice["logprobs"]["tokens"]
                        out.top += choice["logprobs"]["top_logprobs"] or []
                    if choice.get("finish_reason"):
                        out.finish.append(choice["finish_reason"])
                    if first is not None:
                        first.set()
                chunks += 1
                if read_chunks is not None and chunks >= read_chunks:
                    if leave is not None:
                        if first is not None:
                            first.set()
                        await leave.wait()
                    return out  # leaving the context drops the connection mid-stream
    except httpx.HTTPError as exc:
        if not record_http_errors:
            raise
        out.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        out.done_at = time.monotonic()
        if first is not None:
            first.set()
    return out
