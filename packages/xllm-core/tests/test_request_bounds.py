"""The engine's request validation applies the gateway's request limits again (one definition:
:mod:`xllm.engine_api.bounds`), naming the field, cheapest checks first (issue 50, item 2)."""

from __future__ import annotations

import dataclasses

import pytest

from xllm.core.validation import RequestLimits
from xllm.engine_api.bounds import (
    MAX_LOGIT_BIAS,
    MAX_PROMPT_CHARS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    RequestBounds,
)
from xllm.engine_api.errors import InvalidRequestError
from xllm.proto.engine.v1 import engine_pb2
from xllm.testing.engine import make_engine, make_request

VOCAB = 4096


@pytest.fixture(scope="module")
def limits() -> RequestLimits:
    engine = make_engine(kv_cache_backend="paged", block_size=16, kv_cache_memory_gib=0.01)
    try:
        return dataclasses.replace(engine.limits, vocab_size=VOCAB)  # room for 300 logit_bias token ids
    finally:
        engine.close()


def _request(**change) -> engine_pb2.GenerateRequest:
    req = make_request("r", [1, 2, 3], max_tokens=4)
    s = req.sampling
    s.stop.extend(change.get("stop", ()))
    s.stop_token_ids.extend(change.get("stop_token_ids", ()))
    s.logit_bias.update(change.get("logit_bias", {}))
    if "structured" in change:
        s.structured.CopyFrom(change["structured"])
    if "prompt" in change:
        req.prompt_token_ids[:] = change["prompt"]
    return req


def _refused(limits: RequestLimits, req: engine_pb2.GenerateRequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        limits.check(req)
    return info.value


def test_the_engine_has_the_gateways_defaults():
    assert RequestBounds() == RequestBounds(MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS,
                                            MAX_PROMPT_CHARS)
    with pytest.raises(ValueError, match="max_stop"):
        RequestBounds(max_stop=0)


@pytest.mark.parametrize("field, change", [
    ("stop", dict(stop=["x" * 1000] * 2000)),
    ("stop", dict(stop=["x"] * (MAX_STOP + 1))),
    ("stop", dict(stop=["x" * (MAX_STOP_CHARS + 1)])),
    ("stop_token_ids", dict(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))),
    ("logit_bias", dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})),
    ("guided_grammar", dict(structured=engine_pb2.StructuredOutput(grammar="a" * (MAX_PROMPT_CHARS + 1),
                                                                    field="guided_grammar"))),
    ("guided_choice", dict(structured=engine_pb2.StructuredOutput(
        choice=engine_pb2.StringList(values=["ab"] * (MAX_PROMPT_CHARS // 6 + 1)), field="guided_choice"))),
    ("structured", dict(structured=engine_pb2.StructuredOutput(regex="a" * (MAX_PROMPT_CHARS + 1)))),
])
def test_over_the_bounds_is_refused_naming_the_field(limits, field, change):
    assert _refused(limits, _request(**change)).param == field


def test_at_the_bounds_passes(limits):
    limits.check(_request(stop=["\U0001F600" * MAX_STOP_CHARS] * MAX_STOP, stop_token_ids=[7] * MAX_STOP_TOKEN_IDS,
                          logit_bias={i: -1.0 for i in range(MAX_LOGIT_BIAS)}))
    limits.check(_request(structured=engine_pb2.StructuredOutput(grammar="a" * MAX_PROMPT_CHARS)))
    limits.check(_request(structured=engine_pb2.StructuredOutput(
        choice=engine_pb2.StringList(values=["ab"] * (MAX_PROMPT_CHARS // 6)))))
    limits.check(_request(structured=engine_pb2.StructuredOutput(  # as many choices as the gateway lets through
        choice=engine_pb2.StringList(values=[""] * (MAX_PROMPT_CHARS // 4)))))


def test_configured_bounds_apply(limits):
    small = dataclasses.replace(limits, bounds=RequestBounds(max_stop=2, max_grammar_chars=10))
    assert _refused(small, _request(stop=["a", "b", "c"])).param == "stop"
    assert _refused(small, _request(structured=engine_pb2.StructuredOutput(regex="a" * 11, field="guided_regex"))
                    ).param == "guided_regex"
    small.check(_request(stop=["a", "b"], structured=engine_pb2.StructuredOutput(regex="a" * 10)))


def test_cheapest_checks_come_first(limits):
    """Counts before conversions, the prompt's length before its tokens' ranges: a request past a count
    bound is refused for it whatever else is wrong; a prompt past the context is refused for its length,
    not after a scan of its tokens."""
    bad_tokens = [VOCAB + 1] * 8
    assert _refused(limits, _request(prompt=bad_tokens, stop=["x"] * 2000)).param == "stop"
    nan_too_long = _request(prompt=[1] * (limits.max_model_len + 1))
    nan_too_long.sampling.temperature = float("nan")  # found only by the conversion into SamplingParams
    assert _refused(limits, nan_too_long).param == "prompt"
    too_long = _refused(limits, _request(prompt=[-1] * (limits.max_model_len + 1)))
    assert too_long.param == "prompt" and "context length" in str(too_long)
    out_of_range = _refused(limits, _request(prompt=bad_tokens))
    assert out_of_range.param == "prompt" and "must be in" in str(out_of_range)


def test_an_engine_configured_with_other_bounds_applies_them():
    """``EngineConfig.request_bounds`` (the request limit flags) reach the engine's own checks: within them a
    request the defaults refuse passes, past them the engine refuses it alone (no gateway in front)."""
    raised = RequestBounds(max_stop=64, max_stop_chars=1000, max_grammar_chars=MAX_PROMPT_CHARS * 2)
    engine = make_engine(kv_cache_backend="paged", block_size=16, kv_cache_memory_gib=0.01, request_bounds=raised)
    try:
        configured = engine.limits
    finally:
        engine.close()
    assert configured.bounds == raised
    configured.check(_request(stop=["x" * 1000] * 64,
                              structured=engine_pb2.StructuredOutput(grammar="a" * (MAX_PROMPT_CHARS + 1))))
    assert _refused(configured, _request(stop=["x"] * 65)).param == "stop"
    assert _refused(configured, _request(stop=["x" * 1001])).param == "stop"
    assert _refused(configured, _request(structured=engine_pb2.StructuredOutput(
        grammar="a" * (MAX_PROMPT_CHARS * 2 + 1), field="guided_grammar"))).param == "guided_grammar"
