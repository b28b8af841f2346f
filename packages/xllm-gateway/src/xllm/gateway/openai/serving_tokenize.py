"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes, :mod:`xllm.gateway.openai.protocol_tokenize`):
the served model's tokenizer, and for chat messages exactly the rendering a chat request gets
(:meth:`~xllm.gateway.openai.serving_chat.ChatServing.render`), on the preprocessor's threads."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.openai.errors import bad_request
from xllm.gateway.openai.preprocess import Preprocessor
from xllm.gateway.openai.protocol import ChatCompletionRequest
from xllm.gateway.openai.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from xllm.gateway.openai.request_body import validation_error
from xllm.gateway.openai.serving_chat import ChatServing
from xllm.models.tokenizer import Tokenizer


class TokenizeServing:
    """The two routes over one model's tokenizer (the gateway's)."""

    def __init__(self, dispatcher: Dispatcher, chat: ChatServing, tokenizer: Tokenizer, max_model_len: int,
                 preprocessor: Preprocessor) -> None:
        self.dispatcher = dispatcher
        self.chat = chat
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.preprocessor = preprocessor

    async def tokenize(self, req: TokenizeRequest) -> JSONResponse:
        """``{"count", "max_model_len", "tokens", "token_strs"}`` (strings only when asked)."""
        self.dispatcher.resolve_model(req.model)  # 404 for a model this gateway does not serve
        ids = await self.preprocessor.run(self._ids, req)
        strs = await self.preprocessor.run(self.tokenizer.token_strings, ids) if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                             "token_strs": strs})

    def _ids(self, req: TokenizeRequest) -> list[int]:
        if req.prompt is not None:
            return self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        try:
            chat = ChatCompletionRequest(messages=req.messages, tools=req.tools,
                                         add_generation_prompt=req.add_generation_prompt)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        return self.chat.render(chat)

    async def detokenize(self, req: DetokenizeRequest) -> JSONResponse:
        """``{"prompt": text}``; a token id outside the vocabulary is a 400 naming ``tokens``."""
        self.dispatcher.resolve_model(req.model)
        bad = next((t for t in req.tokens if t >= self.tokenizer.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary of {self.tokenizer.vocab_size} tokens",
                              "tokens")
        return JSONResponse({"prompt": await self.preprocessor.run(self.tokenizer.decode, req.tokens)})
