"""``POST /v1/completions``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from xllm.gateway.openai.errors import APIError, bad_request
from xllm.gateway.openai.logprobs import completion_logprobs
from xllm.gateway.openai.protocol import CompletionRequest
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
from xllm.models import Tokenizer


class CompletionServing:
    def __init__(self, dispatcher: Dispatcher, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def _tokenize(self, prompt: str | list[int]) -> tuple[list[int], str]:
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:
            raise bad_request(f"the prompt has {len(ids)} tokens but the context length is {self.max_model_len}",
                              "prompt", "context_length_exceeded")
        if text is None:
            vocab = self.tokenizer.vocab_size
            if min(ids) < 0 or max(ids) >= vocab:
                raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return ids, text

    async def create(self, req: CompletionRequest, raw: Request):
        model = self.dispatcher.resolve_model(req.model)
        prompts = [self._tokenize(p) for p in req.prompts()]
        want_lp = req.logprobs is not None
        rid = new_id("cmpl")
        reqs, prompt_lens, echoes = [], [], []
        for p_idx, (ids, text) in enumerate(prompts):
            for j in range(req.n):
                k = p_idx * req.n + j
                sp = sampling_proto(req, req.max_tokens, want_lp, req.logprobs or 0, seed_offset=j)
                reqs.append(engine_request(f"{rid}-{k}", ids, sp, model, req.priority))
                prompt_lens.append(len(ids))
                echoes.append(text if req.echo else "")
        client, streams = await self.dispatcher.submit_all(model, reqs, session=req.affinity_key())
        headers = {INSTANCE_HEADER: client.info.instance_id}
        created = int(time.time())
        total_prompt = sum(len(ids) for ids, _ in prompts)
        if req.stream:
            return StreamingResponse(self._stream(req, rid, model, created, total_prompt, prompt_lens, echoes,
                                                  streams), media_type="text/event-stream", headers=headers)
        choices = await collect(streams, prompt_lens, raw)
        body = {
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [
                {
                    "index": c.index,
                    "text": echoes[c.index] + c.text,
                    "logprobs": completion_logprobs(c.logprobs, self.tokenizer.token_strings,
                                                    len(echoes[c.index])) if want_lp else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],
            "usage": usage_dict(total_prompt, sum(c.completion_tokens for c in choices),
                                sum(c.cached_tokens for c in choices[:: req.n])),
        }
        return JSONResponse(body, headers=headers)

    async def _stream(self, req: CompletionRequest, rid: str, model: str, created: int, total_prompt: int,
                      prompt_lens: list[int], echoes: list[str], streams: list) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        want_lp = req.logprobs is not None
        completion = [0] * len(streams)
        cached = [0] * len(streams)
        offsets = [len(e) for e in echoes]
        started = [False] * len(streams)

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return sse(json.dumps(body, ensure_ascii=False))

        try:
            async for i, out in merge_streams(streams):
                completion[i] += len(out.token_ids)
                text = out.text
                if not started[i]:
                    text, started[i] = echoes[i] + text, True
                finish = FINISH_NAMES.get(out.finish_reason) if out.finish_reason else None
                if finish:
                    cached[i] = out.usage.cached_prompt_tokens
                if not text and not finish and not out.logprobs:
                    continue
                lp = None
                if want_lp:
                    lp = completion_logprobs(out.logprobs, self.tokenizer.token_strings, offsets[i])
                offsets[i] += len(out.text)
                yield chunk([{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}])
        except APIError as exc:
            yield sse(json.dumps(exc.body()))
        except Exception as exc:
            yield sse(json.dumps(to_api_error(exc).body()))
        else:
            if include_usage:  # cached tokens counted once per prompt, as in the non-streaming answer
                yield chunk([], usage_dict(total_prompt, sum(completion), sum(cached[:: req.n])))
        yield sse("[DONE]")
