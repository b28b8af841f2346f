"""OpenAI request fields -> the engine's ``SamplingParams`` message."""

from __future__ import annotations

from xllm.engine_api.bounds import MIN_TEMPERATURE
from xllm.gateway.openai.protocol import _SamplingFields
from xllm.proto.engine.v1 import engine_pb2


def sampling_proto(req: _SamplingFields, max_tokens: int, logprobs: bool, top_logprobs: int,
                   seed_offset: int = 0, structured: engine_pb2.StructuredOutput | None = None,
                   prompt_logprobs: int | None = None) -> engine_pb2.SamplingParams:
    """Build the engine message; ``seed_offset`` separates the ``n`` choices of
    one seeded request (choice ``i`` uses ``seed + i``); ``structured`` is the output constraint,
    ``prompt_logprobs`` the alternatives per prompt position when the prompt's logprobs are asked
    for. A temperature in (0, ``MIN_TEMPERATURE``)
    is raised to ``MIN_TEMPERATURE`` (vLLM does the same; so does the engine, the constant's home, for
    gRPC callers): a smaller one overflows the scaled logits."""
    sp = engine_pb2.SamplingParams(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=req.stop_list(),
        stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
    )
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            if name == "temperature" and 0 < value < MIN_TEMPERATURE:
                value = MIN_TEMPERATURE
            setattr(sp, name, value)
    if req.top_k is not None and req.top_k > 0:
        sp.top_k = req.top_k
    if req.seed is not None:
        sp.seed = (req.seed + seed_offset) % 2**64
    for key, bias in (req.logit_bias or {}).items():
        sp.logit_bias[int(key)] = bias
    if structured is not None:  # checked by xllm.gateway.openai.structured
        sp.structured.CopyFrom(structured)
    if prompt_logprobs is not None:
        sp.prompt_logprobs = prompt_logprobs
    return sp
