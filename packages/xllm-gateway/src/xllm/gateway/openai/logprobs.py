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


def echo_logprobs(prompt_ids: list[int], entries: Sequence[engine_pb2.TokenLogprob],
                  token_strings: TokenStrings) -> dict:
    """The prompt's part of an ``echo`` + ``logprobs`` completion: every prompt token, the first
    with null logprob and alternatives (nothing precedes it), the rest teacher forced."""
    first = token_strings([prompt_ids[0]])[0] if prompt_ids else ""
    rest = completion_logprobs(entries, token_strings, len(first))
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}


def join_logprobs(head: dict, tail: dict) -> dict:
    """Two legacy-format logprob payloads one after the other."""
    return {key: head[key] + tail[key] for key in head}


def vllm_prompt_logprobs(prompt_ids: list[int], entries: Sequence[engine_pb2.TokenLogprob],
                         token_strings: TokenStrings) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token, then per token
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` for the token and its top alternatives
    (``rank`` of the alternatives only: 1 is the most likely; the prompt token's own is null unless
    it is among them)."""
    out: list[dict | None] = [None] if prompt_ids else []
    for e in entries:
        ids = [e.token_id, *[t.token_id for t in e.top]]
        strings = token_strings(ids)
        row = {str(e.token_id): {"logprob": e.logprob, "rank": None, "decoded_token": strings[0]}}
        for rank, (t, s) in enumerate(zip(e.top, strings[1:]), start=1):
            row[str(t.token_id)] = {"logprob": t.logprob, "rank": rank, "decoded_token": s}
        out.append(row)
    return out
