"""``POST /v1/recommend``: the ``top_n`` catalogue items for a prompt (see
:mod:`xllm.gateway.openai.protocol_recommend`)."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse

from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.openai.errors import bad_request
from xllm.gateway.openai.preprocess import Preprocessor
from xllm.gateway.openai.protocol import Scheduling
from xllm.gateway.openai.protocol_recommend import RecommendRequest
from xllm.gateway.openai.serving import INSTANCE_HEADER, collect, engine_request, new_id, usage_dict
from xllm.models.tokenizer import ChatTemplateError, Tokenizer
from xllm.proto.engine.v1 import engine_pb2


class RecommendServing:
    """Recommendation requests: the prompt tokenized (or chat-templated) off the event loop, one
    catalogue-constrained beam search in the engine, the best ``top_n`` items returned."""

    def __init__(self, dispatcher: Dispatcher, tokenizer: Tokenizer, max_model_len: int,
                 preprocessor: Preprocessor) -> None:
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.preprocessor = preprocessor

    def _prompt(self, req: RecommendRequest) -> list[int]:
        if req.messages is not None:
            try:
                ids = self.tokenizer.apply_chat_template([m.for_template() for m in req.messages])
            except ChatTemplateError as exc:
                raise bad_request(str(exc), "messages") from exc
            field = "messages"
        elif isinstance(req.prompt, str):
            ids, field = self.tokenizer.encode(req.prompt), "prompt"
        else:
            ids, field = list(req.prompt), "prompt"
            if max(ids) >= self.tokenizer.vocab_size:
                raise bad_request(f"prompt token ids must be in [0, {self.tokenizer.vocab_size})", "prompt")
        if not ids:
            raise bad_request("the prompt is empty", field)
        if len(ids) >= self.max_model_len:
            raise bad_request(f"the prompt has {len(ids)} tokens but the context length is {self.max_model_len}",
                              field, "context_length_exceeded")
        return ids

    async def create(self, req: RecommendRequest, raw: Request) -> JSONResponse:
        model = self.dispatcher.resolve_model(req.model)
        prompt = await self.preprocessor.run(self._prompt, req)
        sp = engine_pb2.SamplingParams(max_tokens=1, beam_width=req.width(), item_catalog=True,
                                       length_penalty=0.0)
        if req.top_k is not None:
            sp.top_k = req.top_k
        rid = new_id("rec")
        scheduling = Scheduling(req.priority, False, "default")
        client, streams = await self.dispatcher.submit_all(model, [engine_request(rid, prompt, sp, model, scheduling)],
                                                           session=req.affinity_key())
        (got,) = await collect(streams, [len(prompt)], raw)
        items = [{"rank": i, "item_id": h.item_id, "token_ids": list(h.token_ids), "logprob": h.logprob}
                 for i, h in enumerate(got.beams[:req.top_n])]
        body = {"id": rid, "object": "recommendation", "created": int(time.time()), "model": model,
                "items": items, "usage": usage_dict(len(prompt), got.completion_tokens, got.cached_tokens)}
        return JSONResponse(body, headers={INSTANCE_HEADER: client.info.instance_id})
