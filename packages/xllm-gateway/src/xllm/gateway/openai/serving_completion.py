"""``POST /v1/completions``."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.openai.errors import bad_request
from xllm.gateway.openai.logprobs import completion_logprobs
from xllm.gateway.openai.preprocess import Preprocessor
from xllm.gateway.openai.protocol import CompletionRequest
from xllm.gateway.openai.sampling import sampling_proto
from xllm.gateway.openai.serving import INSTANCE_HEADER, collect, engine_request, new_id, sse_stream, usage_dict
from xllm.models.tokenizer import Tokenizer
from xllm.proto.engine.v1 import engine_pb2


class CompletionServing:
    """Completion requests: every prompt tokenized (or its token ids checked) on the preprocessor's
    threads, ``prompts x n`` choices submitted together, the answer streamed or collected."""

    def __init__(self, dispatcher: Dispatcher, tokenizer: Tokenizer, max_model_len: int,
                 preprocessor: Preprocessor) -> None:
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.preprocessor = preprocessor

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

    def _tokenize_all(self, req: CompletionRequest) -> list[tuple[list[int], str]]:
        return [self._tokenize(p) for p in req.prompts()]

    async def create(self, req: CompletionRequest, raw: Request):
        model = self.dispatcher.resolve_model(req.model)
        prompts = await self.preprocessor.run(self._tokenize_all, req)
        want_lp = req.logprobs is not None
        rid = new_id("cmpl")
        reqs, prompt_lens, echoes = [], [], []
        for p_idx, (ids, text) in enumerate(prompts):
            for j in range(req.n):
                k = p_idx * req.n + j
                sp = sampling_proto(req, req.max_tokens, want_lp, req.logprobs or 0, seed_offset=j)
                reqs.append(engine_request(f"{rid}-{k}", ids, sp, model, req.engine_priority()))
                prompt_lens.append(len(ids))
                echoes.append(text if req.echo else "")
        client, streams = await self.dispatcher.submit_all(model, reqs, session=req.affinity_key())
        headers = {INSTANCE_HEADER: client.info.instance_id}
        created = int(time.time())
        total_prompt = sum(len(ids) for ids, _ in prompts)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            fmt = _CompletionStream(req, self.tokenizer, total_prompt, echoes, prompt_lens)
            return StreamingResponse(sse_stream(fmt, rid, model, created, include_usage, streams),
                                     media_type="text/event-stream", headers=headers)
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


class _CompletionStream:
    """The ``text_completion`` events of one request (see :class:`~xllm.gateway.openai.serving.StreamFormat`)."""

    object = "text_completion"

    def __init__(self, req: CompletionRequest, tokenizer: Tokenizer, total_prompt: int, echoes: list[str],
                 prompt_lens: list[int]) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.total_prompt = total_prompt
        self.echoes = echoes
        self.prompt_lens = prompt_lens  # of each choice
        self.continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        self.completion = [0] * len(echoes)
        self.cached = [0] * len(echoes)
        self.offsets = [len(e) for e in echoes]
        self.started = [False] * len(echoes)

    def opening(self) -> list[dict]:
        return []

    def choice(self, index: int, out: engine_pb2.GenerateResponse, finish: str | None) -> dict | None:
        self.completion[index] += len(out.token_ids)
        text = out.text
        if not self.started[index]:
            text, self.started[index] = self.echoes[index] + text, True
        if finish:
            self.cached[index] = out.usage.cached_prompt_tokens
        if not text and not finish and not out.logprobs:
            return None
        lp = None
        if self.req.logprobs is not None:
            lp = completion_logprobs(out.logprobs, self.tokenizer.token_strings, self.offsets[index])
        self.offsets[index] += len(out.text)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

    def chunk_usage(self, index: int) -> dict | None:
        return usage_dict(self.prompt_lens[index], self.completion[index]) if self.continuous else None

    def final_usage(self) -> dict:
        # cached tokens counted once per prompt, as in the non-streaming answer
        return usage_dict(self.total_prompt, sum(self.completion), sum(self.cached[:: self.req.n]))
