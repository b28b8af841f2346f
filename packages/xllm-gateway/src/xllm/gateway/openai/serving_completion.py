"""``POST /v1/completions``."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.openai.beam import beam_sampling, beam_width, best_hypotheses, check_beam_fields, finish_name
from xllm.gateway.openai.errors import bad_request
from xllm.gateway.openai.logprobs import completion_logprobs, echo_logprobs, join_logprobs, vllm_prompt_logprobs
from xllm.gateway.openai.preprocess import Preprocessor
from xllm.gateway.openai.protocol import CompletionRequest, Scheduling
from xllm.gateway.openai.sampling import sampling_proto
from xllm.gateway.openai.serving import (
    INSTANCE_HEADER,
    collect,
    engine_request,
    new_id,
    sse_stream,
    usage_dict,
    wants_event_ids,
)
from xllm.gateway.openai.stream_ids import StreamSeal, StreamTicket
from xllm.gateway.openai.structured import structured_output
from xllm.gateway.tracing import spans_of
from xllm.models.tokenizer import Tokenizer
from xllm.proto.engine.v1 import engine_pb2


class CompletionServing:
    """Completion requests: every prompt tokenized (or its token ids checked) on the preprocessor's
    threads, ``prompts x n`` choices submitted together, the answer streamed or collected. A stream
    without logprobs or echo gets a resumable id from ``seal`` (:mod:`xllm.gateway.openai.stream_ids`)."""

    def __init__(self, dispatcher: Dispatcher, tokenizer: Tokenizer, max_model_len: int,
                 preprocessor: Preprocessor, seal: StreamSeal | None = None) -> None:
        self.dispatcher = dispatcher
        self.seal = seal or StreamSeal()
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

    def _tokenize_all(self, req: CompletionRequest
                      ) -> tuple[list[tuple[list[int], str]], engine_pb2.StructuredOutput | None]:
        """Every prompt tokenized, and the output constraint (response_format, guided_*) checked."""
        return [self._tokenize(p) for p in req.prompts()], structured_output(req)

    async def create(self, req: CompletionRequest, raw: Request, scheduling: Scheduling):
        model = self.dispatcher.resolve_model(req.model)
        check_beam_fields(req)
        spans = spans_of(raw.scope)
        with spans.phase("tokenize") as span:
            prompts, structured = await self.preprocessor.run(self._tokenize_all, req)
            if span is not None:
                span.set_attribute("gen_ai.usage.input_tokens", sum(len(ids) for ids, _ in prompts))
        spans.set(**{"gen_ai.request.model": model, "xllm.stream": bool(req.stream), "xllm.n": req.n})
        if req.use_beam_search:
            return await self._beam_search(req, raw, scheduling, model, prompts)
        want_lp = req.logprobs is not None
        echo_lp = req.echo and want_lp  # the prompt's logprobs in `logprobs`, before the completion's
        # the prompt's logprobs are computed once per prompt (its first choice) and shared
        prompt_lp = max(req.logprobs if echo_lp else 0, req.prompt_logprobs or 0) \
            if echo_lp or req.prompt_logprobs is not None else None
        best_of = max(req.best_of or req.n, req.n)  # choices generated per prompt; the best n returned
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream and not want_lp and not req.echo and req.prompt_logprobs is None:
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            rid = self.seal.issue(StreamTicket("cmpl", model, created, include_usage, continuous,
                                               tuple(len(ids) for ids, _ in prompts), req.n, scheduling.service_tier))
        else:
            rid = new_id("cmpl")
        reqs, prompt_lens, echoes = [], [], []
        for p_idx, (ids, text) in enumerate(prompts):
            for j in range(best_of):
                k = p_idx * best_of + j
                sp = sampling_proto(req, req.max_tokens, want_lp or best_of > req.n, req.logprobs or 0,
                                    seed_offset=j, structured=structured,
                                    prompt_logprobs=prompt_lp if j == 0 or req.stream else None)
                reqs.append(engine_request(f"{rid}-{k}", ids, sp, model, scheduling))
                prompt_lens.append(len(ids))
                echoes.append(text if req.echo else "")
        client, streams = await self.dispatcher.submit_all(model, reqs, session=req.affinity_key(), spans=spans)
        headers = {INSTANCE_HEADER: client.info.instance_id}
        total_prompt = sum(len(ids) for ids, _ in prompts)
        if req.stream:  # (best_of > 1 is refused with stream)
            fmt = _CompletionStream(req, self.tokenizer, total_prompt, echoes, prompt_lens,
                                    [ids for ids, _ in prompts for _ in range(req.n)])
            return StreamingResponse(sse_stream(fmt, rid, model, created, include_usage, streams,
                                                scheduling.service_tier, event_ids=wants_event_ids(raw.headers)),
                                     media_type="text/event-stream", headers=headers)
        generated = await collect(streams, prompt_lens, raw)
        strings = self.tokenizer.token_strings
        out = []
        for p_idx, (ids, _) in enumerate(prompts):
            group = generated[p_idx * best_of:(p_idx + 1) * best_of]
            prompt_entries = group[0].prompt_logprobs
            if best_of > req.n:  # the highest cumulative logprob first (OpenAI's, vLLM's ranking)
                group = sorted(group, key=lambda c: -sum(e.logprob for e in c.logprobs))[:req.n]
            for c in group:
                echo = echoes[c.index]
                lp = None
                if want_lp:
                    lp = completion_logprobs(c.logprobs, strings, len(echo))
                    if echo_lp:
                        lp = join_logprobs(echo_logprobs(ids, prompt_entries, strings), lp)
                choice = {"index": len(out), "text": echo + c.text, "logprobs": lp, "finish_reason": c.finish_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(ids, prompt_entries, strings)
                out.append(choice)
        body = {
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": out,
            "usage": usage_dict(total_prompt, sum(c.completion_tokens for c in generated),
                                sum(c.cached_tokens for c in generated[:: best_of])),
            "service_tier": scheduling.service_tier,
        }
        return JSONResponse(body, headers=headers)


    async def _beam_search(self, req: CompletionRequest, raw: Request, scheduling: Scheduling, model: str,
                           prompts: list[tuple[list[int], str]]) -> JSONResponse:
        """One beam search per prompt (xllm.gateway.openai.beam); its ``n`` best hypotheses as choices."""
        width = beam_width(req)
        rid = new_id("cmpl")
        reqs = [engine_request(f"{rid}-{i}", ids, beam_sampling(req, width, req.max_tokens), model, scheduling)
                for i, (ids, _) in enumerate(prompts)]
        client, streams = await self.dispatcher.submit_all(model, reqs, session=req.affinity_key(),
                                                           spans=spans_of(raw.scope))
        generated = await collect(streams, [len(ids) for ids, _ in prompts], raw)
        choices = []
        for c in generated:
            for h in best_hypotheses(c, req.n):
                choices.append({"index": len(choices), "text": h.text, "logprobs": None,
                                "finish_reason": finish_name(h)})
        completion = sum(len(h.token_ids) for c in generated for h in best_hypotheses(c, req.n))
        body = {
            "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices,
            "usage": usage_dict(sum(len(ids) for ids, _ in prompts), completion,
                                sum(c.cached_tokens for c in generated)),
            "service_tier": scheduling.service_tier,
        }
        return JSONResponse(body, headers={INSTANCE_HEADER: client.info.instance_id})


class _CompletionStream:
    """The ``text_completion`` events of one request (see :class:`~xllm.gateway.openai.serving.StreamFormat`)."""

    object = "text_completion"

    def __init__(self, req: CompletionRequest, tokenizer: Tokenizer, total_prompt: int, echoes: list[str],
                 prompt_lens: list[int], prompt_ids: list[list[int]]) -> None:
        self.prompt_ids = prompt_ids  # of each choice

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
        first = not self.started[index]
        if first:
            text, self.started[index] = self.echoes[index] + text, True
        if finish:
            self.cached[index] = out.usage.cached_prompt_tokens
        if not text and not finish and not out.logprobs:
            return None
        lp = None
        strings = self.tokenizer.token_strings
        entries = out.prompt_logprobs  # on each choice's first chunk (streaming asks them for every choice)
        if self.req.logprobs is not None:
            lp = completion_logprobs(out.logprobs, strings, self.offsets[index])
            if first and self.req.echo:
                lp = join_logprobs(echo_logprobs(self.prompt_ids[index], entries, strings), lp)
        self.offsets[index] += len(out.text)
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        if first and self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_ids[index], entries, strings)
        return choice

    def chunk_usage(self, index: int) -> dict | None:
        return usage_dict(self.prompt_lens[index], self.completion[index]) if self.continuous else None

    def final_usage(self) -> dict:
        # cached tokens counted once per prompt, as in the non-streaming answer
        return usage_dict(self.total_prompt, sum(self.completion), sum(self.cached[:: self.req.n]))
