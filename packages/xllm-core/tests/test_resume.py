"""A resumed request continues exactly where one uninterrupted run would have.

The oracle is the uninterrupted run of the same request: for every point at which a client could
have been cut off (after each chunk it received), the request is continued on a fresh engine the
way a gateway continues it (prompt + the tokens received, ``resumed_output_tokens``,
``resumed_sent_chars``), and what the client then sees in total — text, tokens, finish reason,
stop reason, usage — must equal the uninterrupted run's. Cases cover greedy and seeded sampled
requests (draws keyed by (seed, output index)), penalties over the output, text held back for a
stop string, a stop string that began before the cut, characters split across tokens (the tiny
vocabulary splits multi-byte characters), and a cut after the last token whose final chunk was lost.
"""

from __future__ import annotations

import pytest

from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import make_engine, make_request
from xllm.testing.tiny import TinyLM

PROMPT = [5, 9, 2, 14, 3, 22]


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return TinyLM(seed=3)


def chunks_of(engine, req: engine_pb2.GenerateRequest) -> list[engine_pb2.GenerateResponse]:
    """Every chunk of ``req`` in order, alone on ``engine``."""
    chunks = list(engine.add_request(req))
    while engine.has_work():
        chunks += [c for c in engine.step() if c.request_id == req.request_id]
    assert chunks and chunks[-1].finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED
    return chunks


def seen(chunks: list[engine_pb2.GenerateResponse]) -> tuple[str, list[int]]:
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]


def continued(engine, req: engine_pb2.GenerateRequest, received: list[engine_pb2.GenerateResponse],
              sent_text: str | None = None) -> tuple[str, list[int], engine_pb2.GenerateResponse]:
    """What the client sees in total when it received ``received`` and the rest comes from a
    continuation on ``engine`` (as xllm.gateway.dispatch builds it)."""
    text, tokens = seen(received)
    if sent_text is not None:
        text = sent_text
    cont = engine_pb2.GenerateRequest()
    cont.CopyFrom(req)
    cont.request_id = f"{req.request_id}#1"
    cont.prompt_token_ids.extend(tokens)
    cont.resumed_output_tokens = len(tokens)
    cont.resumed_sent_chars = len(text)
    rest = chunks_of(engine, cont)
    more_text, more_tokens = seen(rest)
    return text + more_text, tokens + more_tokens, rest[-1]


def assert_same_as_uninterrupted(model, req: engine_pb2.GenerateRequest, **engine_config) -> list:
    one_run = chunks_of(make_engine(model, **engine_config), req)
    text, tokens = seen(one_run)
    final = one_run[-1]
    for cut in range(len(one_run)):
        got_text, got_tokens, got_final = continued(make_engine(model, **engine_config), req, one_run[:cut])
        where = f"cut after {cut} of {len(one_run)} chunks"
        assert got_tokens == tokens, where
        assert got_text == text, where
        assert (got_final.finish_reason, got_final.stop_reason) == (final.finish_reason, final.stop_reason), where
        assert got_final.usage.prompt_tokens == final.usage.prompt_tokens == len(req.prompt_token_ids), where
        assert got_final.usage.completion_tokens == final.usage.completion_tokens == len(tokens), where
    return one_run


SAMPLED = dict(temperature=1.0, seed=1234)


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.0),
    SAMPLED,
    dict(temperature=0.8, seed=99, top_p=0.9, top_k=20, frequency_penalty=0.7, presence_penalty=0.3,
         repetition_penalty=1.2),
    dict(temperature=1.0, seed=7, min_tokens=12),
], ids=["greedy", "seeded", "seeded-penalties", "min-tokens"])
def test_a_resumed_stream_equals_the_uninterrupted_one(model, sampling):
    req = make_request("r", PROMPT, max_tokens=24, **sampling)
    chunks = assert_same_as_uninterrupted(model, req)
    text, _ = seen(chunks)
    if sampling.get("temperature"):
        assert len(set(text)) > 3  # really sampled varied text


def test_a_resumed_stream_equals_the_uninterrupted_one_with_async_scheduling(model):
    assert_same_as_uninterrupted(model, make_request("r", PROMPT, max_tokens=20, **SAMPLED), async_scheduling=True)


def test_split_characters_and_held_back_text_survive_every_cut(model):
    """Over several seeds, the uninterrupted text has characters split across tokens (chunks with
    tokens but no text) and a stop string whose first characters were held back: every cut still
    gives the same text, and a stop string begun before the cut still ends the request."""
    splits = stops_spanning = 0
    for seed in range(6):
        free = chunks_of(make_engine(model), make_request("f", PROMPT, max_tokens=24, temperature=1.0, seed=seed))
        text, _ = seen(free)
        splits += sum(1 for c in free if c.token_ids and not c.text)
        # a stop string around the middle chunk boundary: it starts in one chunk and ends in a later one
        mid = len("".join(c.text for c in free[: len(free) // 2]))
        stop = text[max(mid - 2, 0):mid + 2]
        if len(stop) < 2 or "\ufffd" in stop:
            continue
        req = make_request("s", PROMPT, max_tokens=24, temperature=1.0, seed=seed, stop=[stop, "zzzz"])
        chunks = assert_same_as_uninterrupted(model, req)
        final = chunks[-1]
        if final.stop_reason == stop:
            stops_spanning += 1
    assert splits > 0 and stops_spanning > 0  # the cases this test is about did occur


def test_a_cut_after_the_last_token_ends_at_once_with_the_final_chunk(model):
    """The tokens arrived but not the end of the stream (the text held back with them): the
    continuation ends without a forward, with the held-back text and the true finish reason."""
    for req in (make_request("e", PROMPT, max_tokens=10, stop=["zz"], temperature=1.0, seed=3),
                make_request("s", PROMPT, max_tokens=40, temperature=1.0, seed=11, stop=["e", "a", "o"])):
        one_run = chunks_of(make_engine(model), req)
        text, tokens = seen(one_run)
        before, _ = seen(one_run[:-1])
        engine = make_engine(model)
        calls = model.forward_calls
        got_text, got_tokens, final = continued(engine, req, one_run, sent_text=before)
        assert model.forward_calls == calls  # nothing computed
        assert (got_text, got_tokens) == (text, tokens)
        assert (final.finish_reason, final.stop_reason) == (one_run[-1].finish_reason, one_run[-1].stop_reason)
