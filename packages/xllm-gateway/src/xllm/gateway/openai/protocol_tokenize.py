"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's routes and shapes): the served model's tokenizer and
chat template at the front, without generating anything."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from xllm.gateway.openai.protocol import ChatMessage, Identifier, TokenId, _Strict


class TokenizeRequest(_Strict):
    """A ``prompt`` (text) or chat ``messages`` (rendered with the model's template, as a chat request is)."""

    model: Identifier | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True          # prompt: the tokenizer's BOS and the like
    add_generation_prompt: bool = True       # messages: end with the assistant's turn opened
    tools: list[dict[str, Any]] | None = None  # messages: rendered as a chat request's tools are
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages")
        return self


class DetokenizeRequest(_Strict):
    model: Identifier | None = None
    tokens: list[TokenId]
