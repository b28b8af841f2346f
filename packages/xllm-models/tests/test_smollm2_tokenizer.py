"""The real SmolLM2 tokenizer: chat template, EOS ids, and incremental detokenization
of byte-level BPE output with emoji and CJK split across tokens."""

from __future__ import annotations

import shutil

import pytest

from xllm.core.detokenizer import IncrementalDetokenizer
from xllm.models import ChatTemplateError, Tokenizer

pytestmark = pytest.mark.real_model

TEXTS = [
    "Grüße aus Köln! 😀👍🏽 naïve café",
    "日本語のテキストと中文文本，还有한국어.",
    "Family: 👨‍👩‍👧‍👦, flags 🇯🇵🇫🇷, math ∑∫√ and spaces   here.\n\tTabs too.",
]


def test_eos_and_specials(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.eos_token_ids == frozenset({2})
    assert tok.bos_token_id == 1 and {1, 2} <= tok.all_special_ids
    assert tok.decode([1, 2]) == "" and tok.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"
    assert tok.token_strings([19556, 905]) == ["Hello", " world"]


def test_chat_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == 1 and ids.count(1) == 3  # no extra BOS in front of the template's own
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False).endswith("Hi<|im_end|>\n")
    # the default system prompt is inserted when none is given
    assert "SmolLM" in tok.decode(tok.apply_chat_template([{"role": "user", "content": "x"}]))


def test_model_without_chat_template(smollm2_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    tok = Tokenizer(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.eos_token_ids == frozenset({2})  # from the tokenizer alone


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_of_split_multibyte_characters(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert partial, "the text should contain characters split across tokens"
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say it"}])
    detok = IncrementalDetokenizer.for_prompt(tok, prompt)
    deltas = [detok.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == text
    # pushing several tokens at once gives the same text
    detok = IncrementalDetokenizer.for_prompt(tok, prompt)
    assert "".join(detok.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) + detok.flush() == text


def test_word_boundary_space_after_the_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.encode("The capital of France is")
    out = tok.encode(" Paris, and of Japan is Tokyo.", add_special_tokens=False)
    detok = IncrementalDetokenizer.for_prompt(tok, prompt)
    assert "".join(detok.push([i]) for i in out) == " Paris, and of Japan is Tokyo."
