"""``POST /v1/chat/completions``."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.openai.errors import bad_request
from xllm.gateway.openai.logprobs import chat_logprobs
from xllm.gateway.openai.preprocess import Preprocessor
from xllm.gateway.openai.protocol import ChatCompletionRequest
from xllm.gateway.openai.sampling import sampling_proto
from xllm.gateway.openai.serving import INSTANCE_HEADER, collect, engine_request, new_id, sse_stream, usage_dict
from xllm.models.tokenizer import ChatTemplateError, Tokenizer
from xllm.proto.engine.v1 import engine_pb2


class ChatServing:
    """Chat requests: the template rendered and tokenized on the preprocessor's threads (never on
    the event loop), the ``n`` choices submitted together, the answer streamed or collected."""

    def __init__(self, dispatcher: Dispatcher, tokenizer: Tokenizer, max_model_len: int,
                 preprocessor: Preprocessor) -> None:
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.preprocessor = preprocessor

    def _render(self, req: ChatCompletionRequest) -> list[int]:
        try:
            return self.tokenizer.apply_chat_template([m.for_template() for m in req.messages],
                                                      add_generation_prompt=req.add_generation_prompt,
                                                      tools=req.tools)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from exc

    async def create(self, req: ChatCompletionRequest, raw: Request):
        model = self.dispatcher.resolve_model(req.model)
        prompt = await self.preprocessor.run(self._render, req)
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
                           model, req.engine_priority())
            for i in range(req.n)
        ]
        client, streams = await self.dispatcher.submit_all(model, reqs, session=req.affinity_key())
        headers = {INSTANCE_HEADER: client.info.instance_id}
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            fmt = _ChatStream(req, self.tokenizer, len(prompt), len(streams))
            return StreamingResponse(sse_stream(fmt, rid, model, created, include_usage, streams),
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


class _ChatStream:
    """The ``chat.completion.chunk`` events of one request (see :class:`~xllm.gateway.openai.serving.StreamFormat`)."""

    object = "chat.completion.chunk"

    def __init__(self, req: ChatCompletionRequest, tokenizer: Tokenizer, prompt_tokens: int, n: int) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.prompt_tokens = prompt_tokens
        self.completion = [0] * n
        self.cached = 0
        self.continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def opening(self) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(self.completion))]

    def choice(self, index: int, out: engine_pb2.GenerateResponse, finish: str | None) -> dict | None:
        self.completion[index] += len(out.token_ids)
        delta = {"content": out.text} if out.text else {}
        if finish:
            self.cached = out.usage.cached_prompt_tokens
        if not delta and not finish and not out.logprobs:
            return None
        lp = chat_logprobs(out.logprobs, self.tokenizer.token_strings) if self.req.logprobs else None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def chunk_usage(self, index: int) -> dict | None:
        return usage_dict(self.prompt_tokens, self.completion[index]) if self.continuous else None

    def final_usage(self) -> dict:
        return usage_dict(self.prompt_tokens, sum(self.completion), self.cached)
