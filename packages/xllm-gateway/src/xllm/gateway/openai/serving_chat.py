"""``POST /v1/chat/completions``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from xllm.gateway.openai.errors import APIError, bad_request
from xllm.gateway.openai.logprobs import chat_logprobs
from xllm.gateway.openai.protocol import ChatCompletionRequest
from xllm.gateway.openai.sampling import sampling_proto
from xllm.gateway.openai.serving import (
    FINISH_NAMES,
    INSTANCE_HEADER,
    Dispatcher,
    collect,
    engine_request,
    merge_streams,
    new_id,
    sse,
    to_api_error,
    usage_dict,
)
from xllm.models import ChatTemplateError, Tokenizer


class ChatServing:
    def __init__(self, dispatcher: Dispatcher, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    async def create(self, req: ChatCompletionRequest, raw: Request):
        model = self.dispatcher.resolve_model(req.model)
        try:
            prompt = self.tokenizer.apply_chat_template([m.for_template() for m in req.messages],
                                                        add_generation_prompt=req.add_generation_prompt,
                                                        tools=req.tools)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from exc
        if len(prompt) >= self.max_model_len:
            raise bad_request(f"the conversation has {len(prompt)} tokens but the context length is "
                              f"{self.max_model_len}", "messages", "context_length_exceeded")
        max_tokens = req.max_new_tokens()
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt)
        rid = new_id("chatcmpl")
        reqs = [
            engine_request(f"{rid}-{i}", prompt,
                           sampling_proto(req, max_tokens, req.logprobs, req.top_logprobs or 0, seed_offset=i),
                           model, req.priority)
            for i in range(req.n)
        ]
        client, streams = await self.dispatcher.submit_all(model, reqs, session=req.affinity_key())
        headers = {INSTANCE_HEADER: client.info.instance_id}
        created = int(time.time())
        if req.stream:
            return StreamingResponse(self._stream(req, rid, model, created, len(prompt), streams),
                                     media_type="text/event-stream", headers=headers)
        choices = await collect(streams, [len(prompt)] * req.n, raw)
        completion = sum(c.completion_tokens for c in choices)
        body = {
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c.logprobs, self.tokenizer.token_strings) if req.logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],
            "usage": usage_dict(len(prompt), completion, choices[0].cached_tokens),
        }
        return JSONResponse(body, headers=headers)

    async def _stream(self, req: ChatCompletionRequest, rid: str, model: str, created: int,
                      prompt_tokens: int, streams: list) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        completion = [0] * len(streams)
        cached = 0

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": choices}
            if include_usage:
                body["usage"] = usage
            return sse(json.dumps(body, ensure_ascii=False))

        for i in range(len(streams)):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        try:
            async for i, out in merge_streams(streams):
                completion[i] += len(out.token_ids)
                delta = {"content": out.text} if out.text else {}
                finish = FINISH_NAMES.get(out.finish_reason) if out.finish_reason else None
                if finish:
                    cached = out.usage.cached_prompt_tokens
                if not delta and not finish and not out.logprobs:
                    continue
                lp = chat_logprobs(out.logprobs, self.tokenizer.token_strings) if req.logprobs else None
                usage = usage_dict(prompt_tokens, completion[i]) if continuous else None
                yield chunk([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}], usage)
        except APIError as exc:
            yield sse(json.dumps(exc.body()))
        except Exception as exc:  # engine died mid-stream: tell the client, then end the stream
            yield sse(json.dumps(to_api_error(exc).body()))
        else:
            if include_usage:
                yield chunk([], usage_dict(prompt_tokens, sum(completion), cached))
        yield sse("[DONE]")
