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
