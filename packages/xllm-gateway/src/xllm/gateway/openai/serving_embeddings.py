"""``POST /v1/embeddings``: each input tokenized at the front (its model's tokenizer), its pooled final hidden
state computed by an instance of the model (:meth:`~xllm.gateway.dispatch.Dispatcher.embed`), answered in
OpenAI's shape (floats, or base64 of little-endian float32 with ``encoding_format: base64``)."""

from __future__ import annotations

import base64
import struct

from fastapi.responses import JSONResponse

from xllm.gateway.dispatch import Dispatcher
from xllm.gateway.openai.errors import bad_request
from xllm.gateway.openai.preprocess import Preprocessor
from xllm.gateway.openai.protocol_embeddings import EmbeddingRequest
from xllm.models.tokenizer import Tokenizer


class EmbeddingsServing:
    """One model's embeddings route (its tokenizer and context length)."""

    def __init__(self, dispatcher: Dispatcher, tokenizer: Tokenizer, max_model_len: int,
                 preprocessor: Preprocessor) -> None:
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.preprocessor = preprocessor

    def _tokenize(self, req: EmbeddingRequest) -> list[list[int]]:
        out = []
        for x in req.inputs():
            ids = self.tokenizer.encode(x, add_special_tokens=req.add_special_tokens) if isinstance(x, str) else x
            if not ids or len(ids) > self.max_model_len:
                raise bad_request(f"an input has {len(ids)} tokens; between 1 and {self.max_model_len} are served",
                                  "input")
            if max(ids) >= self.tokenizer.vocab_size:
                raise bad_request(f"input token ids must be in [0, {self.tokenizer.vocab_size})", "input")
            out.append(ids)
        return out

    async def create(self, req: EmbeddingRequest) -> JSONResponse:
        name = self.dispatcher.resolve_model(req.model)
        model, adapter = self.dispatcher.base_of(name)
        if adapter:
            raise bad_request(f"{adapter!r} is a LoRA adapter: embeddings are the base model's", "model")
        prompts = await self.preprocessor.run(self._tokenize, req)
        vectors = await self.dispatcher.embed(model, prompts, req.pooling, req.normalize)
        data = [{"object": "embedding", "index": i,
                 "embedding": _b64(v) if req.encoding_format == "base64" else v} for i, v in enumerate(vectors)]
        tokens = sum(len(p) for p in prompts)
        return JSONResponse({"object": "list", "data": data, "model": name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _b64(values: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
