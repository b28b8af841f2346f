"""Text output through the engine with the REAL SmolLM2 tokenizer (byte-level BPE): emoji, CJK
and accented text whose characters are split across several tokens are streamed without a
single U+FFFD and reassemble to ``decode(tokens)``; stop strings that start or end inside a
split character, stop token ids, EOS, ``ignore_eos`` and ``min_tokens`` act on the right token.

The model is scripted (it emits a fixed token sequence and never attends), so every test
knows exactly which tokens the engine samples; everything else -- engine, sampler, output
processor, detokenizer, tokenizer -- is the real thing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from xllm.core import EngineConfig, LLMEngine
from xllm.core.model_api import KVCacheSpec
from xllm.proto.engine.v1 import engine_pb2

pytestmark = pytest.mark.real_model

STOP = engine_pb2.FINISH_REASON_STOP
LENGTH = engine_pb2.FINISH_REASON_LENGTH
TEXT = "Grüße 😀👍🏽 from 東京 and 北京, naïve café — 👨‍👩‍👧 done."


class ScriptedLM(nn.Module):
    """Emits ``script[k]`` as the ``k``-th output token of a prompt of ``prompt_len`` tokens
    (a one-hot logit of 30), then EOS. The hidden state is just the position."""

    def __init__(self, vocab: int, prompt_len: int, script: list[int], eos: int) -> None:
        super().__init__()
        self.vocab_size, self.max_context_len = vocab, 512
        self.prompt_len, self.script, self.eos = prompt_len, list(script), eos

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(1, 1, 8, 8)

    def forward(self, input_ids, positions, ctx):
        return positions.to(torch.float32).unsqueeze(1)

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], self.vocab_size)
        for i, pos in enumerate(hidden[:, 0].long().tolist()):
            k = pos - (self.prompt_len - 1)
            logits[i, self.script[k] if 0 <= k < len(self.script) else self.eos] = 30.0
        return logits


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer) -> list[int]:
    return smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}])


def generate(tok, prompt, script, **sampling) -> tuple[list[engine_pb2.GenerateResponse], LLMEngine]:
    eos = min(tok.eos_token_ids)
    model = ScriptedLM(tok.vocab_size, len(prompt), script, eos)
    eng = LLMEngine(model, tok, EngineConfig(dtype=torch.float32, max_model_len=256, num_threads=1,
                                             kv_cache_memory_gib=0.01))
    sampling.setdefault("temperature", 0)
    sampling.setdefault("max_tokens", len(script) + 5)
    eng.add_request(engine_pb2.GenerateRequest(request_id="r", prompt_token_ids=prompt,
                                               sampling=engine_pb2.SamplingParams(**sampling)))
    chunks = []
    while eng.has_work():
        chunks.extend(eng.step())
    return chunks, eng


def test_split_characters_stream_cleanly(smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    split = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert len(split) >= 8  # many tokens carry only part of a character
    chunks, _ = generate(tok, prompt, ids)
    assert [t for c in chunks for t in c.token_ids] == [*ids, min(tok.eos_token_ids)]
    assert all("\ufffd" not in c.text for c in chunks)
    assert "".join(c.text for c in chunks) == TEXT
    assert chunks[-1].finish_reason == STOP
    # some steps emitted nothing (a character was still incomplete) and no chunk broke a character
    assert any(not c.text for c in chunks[:-1])


@pytest.mark.parametrize("stop", ["😀", "🏽 from 東", "京 and", "é —"])
def test_stop_strings_inside_split_characters(smollm2_tokenizer, prompt, stop):
    tok = smollm2_tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    chunks, _ = generate(tok, prompt, ids, stop=[stop])
    text = "".join(c.text for c in chunks)
    assert text == TEXT[:TEXT.index(stop)]
    assert chunks[-1].finish_reason == STOP and chunks[-1].stop_reason == stop
    # the request ended on the token that completed the stop string, not later
    n = len([t for c in chunks for t in c.token_ids])
    assert stop in tok.decode(ids[:n]) and stop not in tok.decode(ids[:n - 1])
    chunks, _ = generate(tok, prompt, ids, stop=[stop], include_stop_str_in_output=True)
    assert "".join(c.text for c in chunks) == TEXT[:TEXT.index(stop) + len(stop)]


def test_stop_token_ids_eos_ignore_eos_and_min_tokens(smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    eos = min(tok.eos_token_ids)
    ids = tok.encode(" one two three four five six", add_special_tokens=False)
    # a stop token id ends the request; its text is not part of the output
    chunks, _ = generate(tok, prompt, ids, stop_token_ids=[ids[3]])
    assert [t for c in chunks for t in c.token_ids] == ids[:4]
    assert "".join(c.text for c in chunks) == tok.decode(ids[:3])
    assert chunks[-1].finish_reason == STOP and chunks[-1].stop_reason == str(ids[3])
    # EOS in the middle of the script: stops there unless ignore_eos
    script = [*ids[:2], eos, *ids[2:]]
    chunks, _ = generate(tok, prompt, script)
    assert [t for c in chunks for t in c.token_ids] == [*ids[:2], eos] and chunks[-1].finish_reason == STOP
    chunks, _ = generate(tok, prompt, script, ignore_eos=True, max_tokens=len(script))
    assert [t for c in chunks for t in c.token_ids] == script and chunks[-1].finish_reason == LENGTH
    assert "".join(c.text for c in chunks) == tok.decode(script)  # EOS is special: not in the text
    # min_tokens: EOS (and stop ids) are banned until 3 tokens exist, so the scripted EOS at
    # index 2 is replaced by the next-best token and generation continues
    chunks, _ = generate(tok, prompt, script, min_tokens=3, max_tokens=6)
    out = [t for c in chunks for t in c.token_ids]
    assert out[:2] == ids[:2] and out[2] != eos and len(out) == 6 and chunks[-1].finish_reason == LENGTH
