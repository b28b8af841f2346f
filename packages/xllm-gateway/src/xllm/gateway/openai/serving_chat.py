"""``POST /v1/chat/completions``."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.media.intake import MediaIntake, engine_images, expand_image_tokens
from xllm.gateway.openai.beam import beam_sampling, beam_width, best_hypotheses, check_beam_fields, finish_name
from xllm.gateway.openai.errors import bad_request
from xllm.gateway.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from xllm.gateway.openai.preprocess import Preprocessor
from xllm.gateway.openai.protocol import ChatCompletionRequest, Scheduling
from xllm.gateway.openai.sampling import sampling_proto
from xllm.gateway.openai.serving import (
    INSTANCE_HEADER,
    Choice,
    collect,
    engine_request,
    new_id,
    sse_stream,
    usage_dict,
    wants_event_ids,
)
from xllm.gateway.openai.stream_ids import StreamSeal, StreamTicket
from xllm.gateway.openai.structured import structured_output
from xllm.gateway.openai.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS
from xllm.gateway.openai.tools import ToolCallStream, ToolChoice, ToolParser
from xllm.gateway.tracing import spans_of
from xllm.models.tokenizer import ChatTemplateError, Tokenizer
from xllm.proto.engine.v1 import engine_pb2


class ChatServing:
    """Chat requests: the template rendered and tokenized on the preprocessor's threads (never on
    the event loop), the ``n`` choices submitted together, the answer streamed or collected. A stream
    without logprobs or tools gets a resumable id from ``seal`` (:mod:`xllm.gateway.openai.stream_ids`)."""

    def __init__(self, dispatcher: Dispatcher, tokenizer: Tokenizer, max_model_len: int,
                 preprocessor: Preprocessor, tool_parser: str = DEFAULT_TOOL_PARSER,
                 seal: StreamSeal | None = None, media: MediaIntake | None = None) -> None:
        self.dispatcher = dispatcher
        self.media = media or MediaIntake()
        self.seal = seal or StreamSeal()
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.preprocessor = preprocessor
        self.tool_parser: ToolParser = TOOL_PARSERS.create(tool_parser)

    def render(self, req: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids exactly as a chat request of these messages and tools is rendered
        (``POST /tokenize``); a 400 naming ``messages`` when the template fails. CPU-bound."""
        return self._render(req)[0]

    def _render(self, req: ChatCompletionRequest) -> tuple[list[int], engine_pb2.StructuredOutput | None]:
        """The prompt (tools described as the tool parser's family expects when the template does not
        render them) and the output constraint (a forced tool call, response_format, guided_*)."""
        choice = ToolChoice.of(req.tools, req.tool_choice)
        messages = [m.for_template() for m in req.messages]
        renders = self.tokenizer.template_renders_tools
        tools = req.tools if choice.mode != "none" else None
        messages = self.tool_parser.prepare(messages, tools or [], renders)
        tool_grammar = None
        if choice.forced:
            tool_grammar = self.tool_parser.forced_grammar(req.tools, choice, req.parallel_tool_calls is not False)
        structured = structured_output(req, tool_grammar)
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                        tools=tools if renders else None)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from exc
        return prompt, structured

    def _message(self, req: ChatCompletionRequest, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished choice (tool calls parsed out) and its finish reason."""
        if ToolChoice.of(req.tools, req.tool_choice).mode == "none":
            return {"role": "assistant", "content": text}, finish
        parsed = self.tool_parser.parse(text)
        if not parsed.tool_calls:
            return {"role": "assistant", "content": text}, finish
        calls = parsed.tool_calls[:1] if req.parallel_tool_calls is False else parsed.tool_calls
        return ({"role": "assistant", "content": parsed.content, "tool_calls": calls},
                "tool_calls" if finish == "stop" else finish)

    async def create(self, req: ChatCompletionRequest, raw: Request, scheduling: Scheduling):
        model = self.dispatcher.resolve_model(req.model)
        check_beam_fields(req)
        if req.stream and req.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs is not streamed in chat completions; use /v1/completions",
                              "prompt_logprobs")
        spans = spans_of(raw.scope)
        images = None
        if any(m.has_images() for m in req.messages):  # fetched, decoded, the model's processor (400s name parts)
            images = await self.media.load([m.content_json() for m in req.messages], self.tokenizer,
                                           self.preprocessor.run)
        with spans.phase("tokenize") as span:
            prompt, structured = await self.preprocessor.run(self._render, req)
            if images is not None:
                prompt = expand_image_tokens(prompt, self.tokenizer.image_token_id, images)
            if span is not None:
                span.set_attribute("gen_ai.usage.input_tokens", len(prompt))
        spans.set(**{"gen_ai.request.model": model, "xllm.stream": bool(req.stream), "xllm.n": req.n})
        if len(prompt) >= self.max_model_len:
            raise bad_request(f"the conversation has {len(prompt)} tokens but the context length is "
                              f"{self.max_model_len}", "messages", "context_length_exceeded")
        max_tokens = req.max_new_tokens()
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt)
        created = int(time.time())
        tools = ToolChoice.of(req.tools, req.tool_choice).mode != "none"
        if req.stream and not req.logprobs and not tools and not req.use_beam_search and images is None:
            rid = self.seal.issue(StreamTicket("chatcmpl", model, created, bool(
                req.stream_options and req.stream_options.include_usage), bool(
                req.stream_options and req.stream_options.continuous_usage_stats), (len(prompt),), req.n,
                scheduling.service_tier))
        else:
            rid = new_id("chatcmpl")
        if req.use_beam_search:  # one search of n beams; its n best hypotheses are the choices
            reqs = [engine_request(f"{rid}-0", prompt, beam_sampling(req, beam_width(req), max_tokens), model,
                                   scheduling)]
        else:
            reqs = [
                engine_request(f"{rid}-{i}", prompt,
                               sampling_proto(req, max_tokens, req.logprobs, req.top_logprobs or 0, seed_offset=i,
                                              structured=structured,
                                              prompt_logprobs=req.prompt_logprobs if i == 0 else None),
                               model, scheduling)
                for i in range(req.n)
            ]
        if images is not None:
            for r in reqs:
                r.images.extend(engine_images(images))
        client, streams = await self.dispatcher.submit_all(model, reqs, session=req.affinity_key(), spans=spans)
        headers = {INSTANCE_HEADER: client.info.instance_id}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            fmt = _ChatStream(req, self.tokenizer, len(prompt), len(streams), self.tool_parser if tools else None)
            return StreamingResponse(sse_stream(fmt, rid, model, created, include_usage, streams,
                                                scheduling.service_tier, event_ids=wants_event_ids(raw.headers)),
                                     media_type="text/event-stream", headers=headers)
        choices = await collect(streams, [len(prompt)] * len(reqs), raw)
        if req.use_beam_search:
            choices = [Choice(i, len(prompt), h.text, list(h.token_ids), finish_reason=finish_name(h),
                              completion_tokens=len(h.token_ids), cached_tokens=choices[0].cached_tokens)
                       for i, h in enumerate(best_hypotheses(choices[0], req.n))]
        completion = sum(c.completion_tokens for c in choices)
        messages = [self._message(req, c.text, c.finish_reason) for c in choices]
        body = {
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": chat_logprobs(c.logprobs, self.tokenizer.token_strings) if req.logprobs else None,
                    "finish_reason": finish,
                }
                for c, (message, finish) in zip(choices, messages, strict=True)
            ],
            "usage": usage_dict(len(prompt), completion, choices[0].cached_tokens),
            **({"prompt_logprobs": vllm_prompt_logprobs(prompt, choices[0].prompt_logprobs,
                                                        self.tokenizer.token_strings)}
               if req.prompt_logprobs is not None else {}),
            "service_tier": scheduling.service_tier,
        }
        return JSONResponse(body, headers=headers)


class _ChatStream:
    """The ``chat.completion.chunk`` events of one request (see :class:`~xllm.gateway.openai.serving.StreamFormat`)."""

    object = "chat.completion.chunk"

    def __init__(self, req: ChatCompletionRequest, tokenizer: Tokenizer, prompt_tokens: int, n: int,
                 tool_parser: ToolParser | None = None) -> None:
        self.req = req
        # tool calls parsed out of each choice's text as it streams (None: tools not in play)
        self.tool_streams: list[ToolCallStream] | None = \
            [tool_parser.stream() for _ in range(n)] if tool_parser is not None else None
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
        if self.tool_streams is not None:
            finish, delta = self._tool_delta(index, out.text, finish)
        if finish:
            self.cached = out.usage.cached_prompt_tokens
        if not delta and not finish and not out.logprobs:
            return None
        lp = chat_logprobs(out.logprobs, self.tokenizer.token_strings) if self.req.logprobs else None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def _tool_delta(self, index: int, text: str, finish: str | None) -> tuple[str | None, dict]:
        stream = self.tool_streams[index]
        content, calls = stream.feed(text)
        if finish:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
            if stream.calls and finish == "stop":
                finish = "tool_calls"
        if self.req.parallel_tool_calls is False:  # one call at most: the first
            calls = [c for c in calls if c["index"] == 0]
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return finish, delta

    def chunk_usage(self, index: int) -> dict | None:
        return usage_dict(self.prompt_tokens, self.completion[index]) if self.continuous else None

    def final_usage(self) -> dict:
        return usage_dict(self.prompt_tokens, sum(self.completion), self.cached)
