"""``POST /v1/embeddings``: OpenAI's request, with vLLM's ``add_special_tokens`` and xLLM's ``pooling`` /
``normalize`` (how the served model's final hidden states are pooled: :mod:`xllm.core.embedding`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from xllm.gateway.openai.protocol import Identifier, TokenId, _refuse_set, _Strict


class EmbeddingRequest(_Strict):
    model: Identifier | None = None
    input: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    user: Identifier | None = None
    add_special_tokens: bool = True   # vLLM: text inputs get the tokenizer's special tokens (BOS ...)
    pooling: Literal["last", "mean"] = "last"  # xLLM: the last token's hidden state, or the mean over the input
    normalize: bool = True            # xLLM: unit L2 norm
    dimensions: Any = None

    _refused = _refuse_set({"dimensions": "dimensions is not supported: an embedding has the model's hidden size"})

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if x and isinstance(x[0], int):
            return [list(x)]
        return list(x)
