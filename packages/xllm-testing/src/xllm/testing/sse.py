"""Reading a server-sent-events body in tests."""

from __future__ import annotations

import json


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


async def stream_completion(client, body: dict, first=None, out: dict | None = None,
                            record_http_errors: bool = False) -> dict:
    """POST a streaming ``/v1/completions`` ``body`` with ``client`` (an ``httpx.AsyncClient``) and
    read it to the end: ``status``, ``instance`` (the ``x-xllm-instance`` header), ``text``,
    ``tokens`` and ``top`` (with ``logprobs`` in the body), ``finish`` reasons, ``usage``, in-stream
    ``errors``. ``first`` (an ``asyncio.Event``) is set at the first choice chunk (and at the end);
    ``out`` (a dict) is filled as the stream goes, for callers that look at it meanwhile;
    ``record_http_errors``: a failed connection is recorded in ``errors`` instead of raised."""
    import httpx

    out = out if out is not None else {}
    out.update({"instance": None, "status": None, "usage": None, "finish": [], "errors": [], "text": "",
                "tokens": [], "top": []})
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            out["status"], out["instance"] = resp.status_code, resp.headers.get("x-xllm-instance")
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["errors"].append(event["error"])
                    continue
                if event.get("usage"):
                    out["usage"] = event["usage"]
                for choice in event.get("choices", []):
                    out["text"] += choice.get("text") or ""
                    if choice.get("logprobs"):
                        out["tokens"] += choice["logprobs"]["tokens"]
                        out["top"] += choice["logprobs"]["top_logprobs"]
                    if choice.get("finish_reason"):
                        out["finish"].append(choice["finish_reason"])
                    if first is not None:
                        first.set()
    except httpx.HTTPError as exc:
        if not record_http_errors:
            raise
        out["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        if first is not None:
            first.set()
    return out
