"""``POST /v1/recommend``: generative recommendation over the engine's item catalogue (an xLLM extension).

The prompt (text, token ids, or chat messages) is a user's history; the engine beam-searches the
catalogue's items (``--item-catalog``: fixed-length token tuples) and the answer is the ``top_n``
items with their log-probabilities under the model (xllm.core.beam).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from xllm.engine_api.bounds import MAX_BEAM_WIDTH
from xllm.gateway.openai.protocol import INT32_MAX, Identifier, TextChatMessage, TokenId, _Strict


class RecommendRequest(_Strict):
    model: Identifier | None = None
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | None = None
    messages: Annotated[list[TextChatMessage], Field(min_length=1)] | None = None
    top_n: Annotated[int, Field(ge=1, le=MAX_BEAM_WIDTH)] = 10
    beam_width: Annotated[int, Field(ge=1, le=MAX_BEAM_WIDTH)] | None = None  # default: top_n
    top_k: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None  # candidates per beam (default: all allowed)
    session_id: Identifier | None = None
    user: Identifier | None = None
    priority: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0  # 0 or lower precedence (no permission needed)

    @model_validator(mode="after")
    def _one_prompt(self) -> RecommendRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self

    @field_validator("beam_width")
    @classmethod
    def _wide_enough(cls, v: int | None, info) -> int | None:
        top_n = info.data.get("top_n", 10)
        if v is not None and v < top_n:
            raise ValueError(f"must be at least top_n ({top_n})")
        return v

    def width(self) -> int:
        return self.beam_width or self.top_n

    def affinity_key(self) -> str | None:
        return self.session_id or self.user or None
