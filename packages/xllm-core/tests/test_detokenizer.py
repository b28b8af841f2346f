"""IncrementalDetokenizer: multi-byte UTF-8 split across tokens, prompt context, flush."""

from __future__ import annotations

import random

import pytest

from xllm.core.detokenizer import IncrementalDetokenizer
from xllm.testing.tiny import PieceTokenizer

TEXT = "Grüße, 世界! 😀👍🏽 naïve café — 日本語 🇯🇵 and 👨‍👩‍👧 done."


def split_bytes(data: bytes, rng: random.Random, max_piece: int = 4) -> list[bytes]:
    pieces, i = [], 0
    while i < len(data):
        n = rng.randint(1, max_piece)
        pieces.append(data[i:i + n])
        i += n
    return pieces


@pytest.mark.parametrize("seed", range(8))
def test_split_multibyte_characters_never_emit_replacement_chars(seed):
    tok = PieceTokenizer([])
    pieces = split_bytes(TEXT.encode(), random.Random(seed))
    assert sum(not _valid_utf8(p) for p in pieces) >= 5  # plenty of characters are split
    ids = tok.encode_pieces(pieces)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == tok.decode(ids)
    assert detok.flush() == ""


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_one_byte_per_token_emits_each_character_once_complete():
    tok = PieceTokenizer([])
    ids = tok.encode_pieces([bytes([b]) for b in "a😀b".encode()])
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == ["a", "", "", "", "😀", "b"]
    assert detok.flush() == ""


def test_several_tokens_pushed_at_once():
    tok = PieceTokenizer([])
    ids = tok.encode_pieces(split_bytes(TEXT.encode(), random.Random(99), max_piece=2))
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push(ids[i:i + 3]) for i in range(0, len(ids), 3))
    assert "\ufffd" not in out and out + detok.flush() == TEXT


def test_incomplete_character_at_the_end_is_released_by_flush():
    tok = PieceTokenizer([])
    ids = tok.encode_pieces(["ok ", b"\xf0\x9f"])  # half an emoji, then the request ends
    detok = IncrementalDetokenizer(tok)
    assert detok.push([ids[0]]) == "ok "
    assert detok.push([ids[1]]) == ""
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_prompt_context_keeps_the_leading_space_of_sentencepiece_decoders():
    tok = PieceTokenizer([], strip_leading_space=True)
    prompt = tok.encode_pieces([" Say", " hi"])
    out = tok.encode_pieces([" Hello", " 世", "界", " world"])
    with_ctx = IncrementalDetokenizer.for_prompt(tok, prompt)
    assert "".join(with_ctx.push([i]) for i in out) == " Hello 世界 world"
    bare = IncrementalDetokenizer(tok)
    assert "".join(bare.push([i]) for i in out) == "Hello 世界 world"  # what the context prevents


def test_for_prompt_uses_only_a_short_tail_and_skips_special_tokens():
    tok = PieceTokenizer([b"<s>", b"</s>"], special=frozenset({0, 1}))
    prompt = [0, *tok.encode_pieces(list("abcdefghij"))]
    detok = IncrementalDetokenizer.for_prompt(tok, prompt, skip_special_tokens=True, context=4)
    assert detok.ids == prompt[-4:] and detok.read_offset == 4
    ids = [*tok.encode_pieces(["X"]), 1, *tok.encode_pieces(["Y"])]
    assert "".join(detok.push([i]) for i in ids) == "XY"
    keep = IncrementalDetokenizer.for_prompt(tok, prompt, skip_special_tokens=False)
    assert "".join(keep.push([i]) for i in ids) == "X</s>Y"


def test_window_stays_small():
    """Decoding cost per token must not grow with the output length."""
    tok = PieceTokenizer([])
    ids = tok.encode_pieces(split_bytes((TEXT * 20).encode(), random.Random(5)))
    detok = IncrementalDetokenizer(tok)
    longest = 0
    original = tok.decode

    def spy(window, skip_special_tokens=True):
        nonlocal longest
        longest = max(longest, len(window))
        return original(window, skip_special_tokens)

    tok.decode = spy
    text = "".join(detok.push([i]) for i in ids)
    assert text == TEXT * 20
    assert longest <= 12
