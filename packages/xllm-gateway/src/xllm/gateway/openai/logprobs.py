"""OpenAI logprob payloads from the engine's ``TokenLogprob`` messages."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from xllm.proto.engine.v1 import engine_pb2

TokenStrings = Callable[[list[int]], list[str]]


def chat_logprobs(entries: Sequence[engine_pb2.TokenLogprob], token_strings: TokenStrings) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs}]}`` (chat format)."""
    content = []
    for e in entries:
        top_ids = [t.token_id for t in e.top]
        strings = token_strings([e.token_id, *top_ids])
        content.append({
            "token": strings[0],
            "logprob": e.logprob,
            "bytes": list(strings[0].encode()),
            "top_logprobs": [
                {"token": s, "logprob": t.logprob, "bytes": list(s.encode())}
                for s, t in zip(strings[1:], e.top)
            ],
        })
    return {"content": content}


def completion_logprobs(entries: Sequence[engine_pb2.TokenLogprob], token_strings: TokenStrings,
                        text_offset: int = 0) -> dict:
    """``{tokens, token_logprobs, top_logprobs, text_offset}`` (legacy completions format)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = text_offset
    for e in entries:
        strings = token_strings([e.token_id, *[t.token_id for t in e.top]])
        tokens.append(strings[0])
        token_lps.append(e.logprob)
        tops.append({s: t.logprob for s, t in zip(strings[1:], e.top)} if e.top else None)
        offsets.append(pos)
        pos += len(strings[0])
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
