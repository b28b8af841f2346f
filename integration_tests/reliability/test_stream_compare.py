"""The oracle comparison of the reliability tests (xllm.testing.sse.assert_same_streams), on hand-built
streams: which partings from the uninterrupted run it excuses and which it does not."""

from __future__ import annotations

import pytest

from xllm.testing.sse import CompletionStream, assert_same_streams


def _stream(tokens: list[str], tops: list[dict[str, float]]) -> CompletionStream:
    return CompletionStream(status=200, text="".join(tokens), tokens=tokens, top=tops, finish=["length"])


REF_TOKENS = ["a", "b", "c", "d"]
REF_TOP = [{"a": -0.5, "x": -1.0}, {"b": -0.7, "y": -0.9}, {"c": -1.2, "d": -1.3}, {"d": -0.1, "z": -3.0}]


def _parted(shift: float = 0.0) -> CompletionStream:
    """Parts at position 2 (draws "d" where the reference drew "c"); its logprobs before that moved by ``shift``."""
    tops = [{t: v + shift for t, v in top.items()} for top in REF_TOP]
    return _stream(["a", "b", "d", "d"], tops)


def test_identical_streams_pass():
    ref = _stream(REF_TOKENS, REF_TOP)
    assert assert_same_streams([_stream(REF_TOKENS, REF_TOP)], [ref], [False]) == 0


def test_one_sampled_stream_may_part_where_the_distributions_agree():
    ref = _stream(REF_TOKENS, REF_TOP)
    assert assert_same_streams([_parted(1e-4), _stream(REF_TOKENS, REF_TOP)], [ref, ref], [False, False]) == 1


def test_two_sampled_partings_fail():
    """A seed or output position carried wrongly across a move parts every moved sampled stream."""
    ref = _stream(REF_TOKENS, REF_TOP)
    with pytest.raises(AssertionError, match="2 sampled streams parted"):
        assert_same_streams([_parted(1e-4), _parted(1e-4)], [ref, ref], [False, False])


def test_a_sampled_parting_after_different_distributions_fails():
    ref = _stream(REF_TOKENS, REF_TOP)
    with pytest.raises(AssertionError, match="seeded"):
        assert_same_streams([_parted(0.05)], [ref], [False])


def test_a_greedy_stream_may_not_part_away_from_a_near_tie():
    ref = _stream(REF_TOKENS, REF_TOP)  # at position 2 the reference's top two are 0.1 apart: not a tie
    with pytest.raises(AssertionError, match="greedy"):
        assert_same_streams([_parted(1e-4)], [ref], [True])
