"""OpenAI request fields -> the engine's SamplingParams message (and back through the engine's parser)."""

from __future__ import annotations

import pytest

from xllm.core.sampling_params import SamplingParams
from xllm.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from xllm.gateway.openai.sampling import sampling_proto

MSG = [{"role": "user", "content": "Hi"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSG, **kw})


def test_unset_fields_stay_unset():
    sp = sampling_proto(chat(), max_tokens=10, logprobs=False, top_logprobs=0)
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "top_k", "seed"):
        assert not sp.HasField(name), name
    assert sp.max_tokens == 10
    assert sp.min_tokens == 0
    assert list(sp.stop) == [] and list(sp.stop_token_ids) == []
    assert not sp.ignore_eos and not sp.logprobs and sp.top_logprobs == 0
    assert dict(sp.logit_bias) == {}
    # the engine then applies OpenAI's defaults
    p = SamplingParams.from_proto(sp)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (1.0, 1.0, 0, None, 10)


def test_every_field_is_mapped():
    req = chat(temperature=0.7, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5,
               repetition_penalty=1.1, top_k=40, seed=123, stop=["END", "STOP"], stop_token_ids=[2, 3],
               ignore_eos=True, min_tokens=2, logit_bias={"5": 10.0, "7": -100},
               include_stop_str_in_output=True, skip_special_tokens=False, logprobs=True, top_logprobs=3)
    sp = sampling_proto(req, max_tokens=20, logprobs=True, top_logprobs=3)
    assert sp.temperature == pytest.approx(0.7)
    assert sp.top_p == pytest.approx(0.9)
    assert sp.min_p == pytest.approx(0.05)
    assert sp.presence_penalty == pytest.approx(0.5)
    assert sp.frequency_penalty == pytest.approx(-0.5)
    assert sp.repetition_penalty == pytest.approx(1.1)
    assert sp.top_k == 40
    assert sp.seed == 123
    assert list(sp.stop) == ["END", "STOP"]
    assert list(sp.stop_token_ids) == [2, 3]
    assert sp.ignore_eos and sp.min_tokens == 2
    assert dict(sp.logit_bias) == {5: 10.0, 7: -100.0}
    assert sp.include_stop_str_in_output
    assert sp.HasField("skip_special_tokens") and sp.skip_special_tokens is False
    assert sp.logprobs and sp.top_logprobs == 3
    assert sp.max_tokens == 20
    p = SamplingParams.from_proto(sp)
    assert p.stop == ("END", "STOP")
    assert p.stop_token_ids == frozenset({2, 3})
    assert p.logit_bias == {5: 10.0, 7: -100.0}
    assert p.skip_special_tokens is False


def test_greedy_temperature_zero_is_sent():
    sp = sampling_proto(chat(temperature=0), max_tokens=1, logprobs=False, top_logprobs=0)
    assert sp.HasField("temperature") and sp.temperature == 0.0
    assert SamplingParams.from_proto(sp).greedy


@pytest.mark.parametrize("top_k", [-1, 0])
def test_top_k_disabled_values_are_not_sent(top_k):
    sp = sampling_proto(chat(top_k=top_k), max_tokens=1, logprobs=False, top_logprobs=0)
    assert not sp.HasField("top_k")


def test_seed_offset_separates_choices():
    req = chat(seed=10, n=3)
    seeds = [sampling_proto(req, 5, False, 0, seed_offset=i).seed for i in range(3)]
    assert seeds == [10, 11, 12]
    top = chat(seed=2**63 - 1)
    assert sampling_proto(top, 5, False, 0, seed_offset=1).seed == 2**63  # still a valid uint64
    assert not sampling_proto(chat(), 5, False, 0, seed_offset=1).HasField("seed")


def test_completion_request_maps_the_same_way():
    req = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 4, "stop": "\n", "temperature": 0.2})
    sp = sampling_proto(req, req.max_tokens, logprobs=True, top_logprobs=2)
    assert sp.max_tokens == 4
    assert list(sp.stop) == ["\n"]
    assert sp.temperature == pytest.approx(0.2)
    assert sp.logprobs and sp.top_logprobs == 2


def test_extreme_but_valid_values_encode():
    """Every value the schema accepts fits the proto message (no 500 from an encoding error)."""
    from xllm.gateway.openai.protocol import INT32_MAX, UINT32_MAX

    req = chat(max_tokens=UINT32_MAX, min_tokens=UINT32_MAX, top_k=INT32_MAX, stop_token_ids=[INT32_MAX],
               logit_bias={str(INT32_MAX): 1}, priority=-INT32_MAX - 1, seed=2**63 - 1)
    sp = sampling_proto(req, UINT32_MAX, False, 0)
    assert sp.max_tokens == UINT32_MAX and sp.min_tokens == UINT32_MAX and sp.top_k == INT32_MAX
    assert dict(sp.logit_bias) == {INT32_MAX: 1.0}
