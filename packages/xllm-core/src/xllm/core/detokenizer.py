"""Incremental detokenization: a growing list of token ids -> text deltas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class EngineTokenizer(TokenDecoder, Protocol):
    """What the engine needs from a tokenizer: decoding, and the ids that end a sequence."""

    eos_token_ids: frozenset[int]


@dataclass
class IncrementalDetokenizer:
    """Emits text as tokens arrive, never splitting a multi-byte character.

    Decodes a small window: ``ids[prefix:read]`` was already emitted; the delta
    is ``decode(ids[prefix:]) - decode(ids[prefix:read])`` unless that ends in an
    incomplete UTF-8 sequence (U+FFFD), in which case it waits for more tokens.
    Seeding the window with the prompt's last tokens keeps word-boundary spaces
    right for tokenizers that drop a leading space at the start of a decode.
    """

    decoder: TokenDecoder
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    @classmethod
    def for_prompt(cls, decoder: TokenDecoder, prompt_ids: list[int], skip_special_tokens: bool = True,
                   context: int = 6) -> IncrementalDetokenizer:
        """Text starts after the prompt (its last ``context`` tokens seed the window)."""
        tail = list(prompt_ids[-context:]) if context else []
        return cls(decoder, skip_special_tokens, tail, 0, len(tail))

    def _window(self) -> tuple[str, str]:
        decode = self.decoder.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        after = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        return before, after

    def push(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.ids.extend(token_ids)
        before, after = self._window()
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before, after = self._window()
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""
