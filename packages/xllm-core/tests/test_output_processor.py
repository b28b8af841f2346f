"""OutputProcessor: stop strings across token boundaries, holdback, stop tokens,
EOS, length limits and the chunks a client sees."""

from __future__ import annotations

import random

import pytest

from xllm.core.output_processor import OutputProcessor
from xllm.core.sampling_params import SamplingParams
from xllm.core.sequence import Sequence
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.tiny import PieceTokenizer

STOP = engine_pb2.FINISH_REASON_STOP
LENGTH = engine_pb2.FINISH_REASON_LENGTH
ABORT = engine_pb2.FINISH_REASON_ABORT
UNSET = engine_pb2.FINISH_REASON_UNSPECIFIED
EOS = 0


class Stream:
    """Feeds pieces one token at a time and records every chunk a client would receive."""

    def __init__(self, max_model_len: int = 1000, prompt=("Q", ":"), **params) -> None:
        params.setdefault("max_tokens", 100)
        self.tok = PieceTokenizer([b"</s>"], special=frozenset({EOS}), eos_token_ids=frozenset({EOS}))
        self.proc = OutputProcessor(self.tok, frozenset({EOS}), max_model_len)
        self.seq = Sequence("r", self.tok.encode_pieces(list(prompt)), SamplingParams(**params), arrival_time=0.0)
        self.out = self.proc.new_request(self.seq)
        self.chunks: list[engine_pb2.GenerateResponse] = []

    def feed(self, pieces, logprob=None) -> None:
        for piece in pieces:
            assert not self.out.finished, "fed a token after the request finished"
            t = piece if isinstance(piece, int) else self.tok.encode_pieces([piece])[0]
            self.seq.output_ids.append(t)
            self.proc.append_token(self.out, t, logprob)
            self.chunks.append(self.proc.take_chunk(self.out))
            if self.out.finished:
                return

    @property
    def streamed(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def final(self) -> engine_pb2.GenerateResponse:
        assert self.chunks[-1].finish_reason != UNSET
        return self.chunks[-1]


def test_stop_string_spanning_token_boundaries():
    s = Stream(stop=["lo wo"])
    s.feed(["He", "l", "lo", " w", "orld", "!"])
    assert s.out.finished and len(s.chunks) == 5  # "orld" completes the stop string
    assert s.streamed == "Hel"
    assert s.final.finish_reason == STOP and s.final.stop_reason == "lo wo"
    assert [t for c in s.chunks for t in c.token_ids] == s.seq.output_ids


def test_include_stop_str_in_output():
    s = Stream(stop=["lo wo"], include_stop_str_in_output=True)
    s.feed(["He", "l", "lo", " w", "orld", "!"])
    assert s.streamed == "Hello wo"
    assert s.final.stop_reason == "lo wo"


def test_text_after_the_stop_string_in_the_same_token_is_dropped():
    s = Stream(stop=["\n\n"])
    s.feed(["one", "\n", "\nnext", "more"])
    assert s.streamed == "one" and s.final.finish_reason == STOP
    s = Stream(stop=["\n\n"], include_stop_str_in_output=True)
    s.feed(["one", "\n", "\nnext", "more"])
    assert s.streamed == "one\n\n"


def test_earliest_of_several_stop_strings_wins():
    s = Stream(stop=["xyz", "b"])
    s.feed(["a", "xy", "zb", "c"])
    assert s.streamed == "a" and s.final.stop_reason == "xyz"


def test_holdback_never_streams_a_prefix_that_later_completes():
    s = Stream(stop=["STOP"])
    s.feed(["go ", "S", "T", "O", "P", "never"])
    # "S", "ST", "STO" were held back, never streamed, and then dropped with the stop string
    assert [c.text for c in s.chunks] == ["", "g", "o", " ", ""]
    assert s.final.finish_reason == STOP and all("S" not in c.text for c in s.chunks)


def test_held_back_text_is_released_when_the_stop_string_does_not_complete():
    s = Stream(stop=["STOP"], max_tokens=4)
    s.feed(["go ", "S", "T", "x"])
    assert [c.text for c in s.chunks] == ["", "g", "o", " STx"]
    assert s.final.finish_reason == LENGTH


@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_is_never_retracted_random(seed):
    rng = random.Random(seed)
    alphabet = ["a", "b", "ab", "ba", "c", "abc", "ca", " ", "é", "😀"]
    stops = ["abca", "cab", "😀 b"]
    pieces = [rng.choice(alphabet) for _ in range(60)]
    full = "".join(pieces)
    s = Stream(stop=stops, max_tokens=60)
    sent = ""
    for p in pieces:
        s.feed([p])
        sent += s.chunks[-1].text
        if not s.out.finished:
            # what is sent is a prefix of the final answer and never ends in a stop-string prefix
            # that could still complete
            assert full.startswith(sent)
            pending = s.out.text[len(sent):]
            assert len(pending) <= max(map(len, stops)) - 1
        else:
            break
    hits = [(full.find(x), x) for x in stops if x in full]
    if hits:
        idx, x = min(hits)
        # the stop is detected once the token completing it arrives
        assert s.final.finish_reason == STOP and s.final.stop_reason == x
        assert sent == full[:idx]
    else:
        assert s.final.finish_reason == LENGTH and sent == full


def test_stop_token_ids():
    s = Stream(stop_token_ids=frozenset({7}))
    s.tok.pieces.extend([b"?"] * (8 - len(s.tok.pieces)))  # make id 7 exist
    s.feed(["a", "b", 7, "c"])
    assert s.final.finish_reason == STOP and s.final.stop_reason == "7"
    assert s.streamed == "ab" and list(s.final.token_ids) == [7]
    assert s.seq.output_ids[-1] == 7


def test_eos_stops_unless_ignored():
    s = Stream()
    s.feed(["a", EOS, "b"])
    assert s.final.finish_reason == STOP and s.final.stop_reason == "" and s.streamed == "a"
    assert s.final.usage.completion_tokens == 2 and s.final.usage.prompt_tokens == 2
    s = Stream(ignore_eos=True, max_tokens=3)
    s.feed(["a", EOS, "b"])
    assert s.final.finish_reason == LENGTH and s.streamed == "ab"  # EOS is special: skipped in text
    s = Stream(ignore_eos=True, max_tokens=3, skip_special_tokens=False)
    s.feed(["a", EOS, "b"])
    assert s.streamed == "a</s>b"


def test_max_tokens_and_context_length():
    s = Stream(max_tokens=3)
    s.feed(["x", "y", "z", "never"])
    assert len(s.chunks) == 3 and s.final.finish_reason == LENGTH and s.streamed == "xyz"
    s = Stream(max_model_len=5, max_tokens=100)  # 2 prompt tokens + 3
    s.feed(["x", "y", "z", "never"])
    assert len(s.chunks) == 3 and s.final.finish_reason == LENGTH


def test_final_chunk_flushes_an_incomplete_character():
    s = Stream(max_tokens=2)
    s.feed(["ok", b"\xe6\x97"])
    assert s.streamed == "ok\ufffd" and s.final.finish_reason == LENGTH


def test_logprobs_are_attached_to_their_chunk():
    s = Stream(max_tokens=2, logprobs=True, top_logprobs=2)
    s.feed(["a", "b"], logprob=(-0.5, [(3, -0.5), (4, -1.5)]))
    lp = s.chunks[0].logprobs
    assert len(lp) == 1 and lp[0].logprob == pytest.approx(-0.5)
    assert [(t.token_id, t.logprob) for t in lp[0].top] == [(3, -0.5), (4, -1.5)]
    assert len(s.chunks[1].logprobs) == 1


def test_abort():
    s = Stream(stop=["zzz"])
    s.feed(["hello", " z"])
    s.proc.abort(s.out)
    final = s.proc.take_chunk(s.out)
    assert final.finish_reason == ABORT and s.streamed + final.text == "hello z"
    assert final.usage.completion_tokens == 2
