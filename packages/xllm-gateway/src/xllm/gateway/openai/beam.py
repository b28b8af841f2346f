"""vLLM's beam search on the OpenAI routes (``use_beam_search``), served by the engine (xllm.core.beam).

One engine request per prompt decodes ``best_of`` (completions) or ``n`` beams; the answer's
choices are the ``n`` best finished hypotheses, best first (HF ``generate(num_beams)`` ranking:
summed log-probs over ``len ** length_penalty``). Beam search is deterministic: the sampling
fields, per-token logprobs, stop strings, output constraints and streaming are refused with a 400
naming the field (the engine checks the sampling fields again, for gRPC callers).
"""

from __future__ import annotations

from xllm.gateway.openai.errors import bad_request
from xllm.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from xllm.proto.engine.v1 import engine_pb2

_EARLY_STOPPING = {True: "true", False: "false", "never": "never"}


def check_beam_fields(req: ChatCompletionRequest | CompletionRequest) -> None:
    """A 400 naming the first field beam search cannot serve (or a beam field without it)."""
    if not req.use_beam_search:
        for name in ("length_penalty", "early_stopping"):
            if getattr(req, name) is not None:
                raise bad_request(f"{name} is only used with use_beam_search", name)
        return
    refused = {
        "stream": req.stream,
        "temperature": req.temperature not in (None, 0),
        "top_p": req.top_p not in (None, 1),
        "min_p": req.min_p not in (None, 0),
        "presence_penalty": req.presence_penalty not in (None, 0),
        "frequency_penalty": req.frequency_penalty not in (None, 0),
        "repetition_penalty": req.repetition_penalty not in (None, 1),
        "logit_bias": bool(req.logit_bias),
        "stop": bool(req.stop_list()),
        "response_format": req.response_format is not None and req.response_format.type != "text",
        "guided_json": req.guided_json is not None, "guided_regex": req.guided_regex is not None,
        "guided_choice": req.guided_choice is not None, "guided_grammar": req.guided_grammar is not None,
        "prompt_logprobs": req.prompt_logprobs is not None,
    }
    if isinstance(req, ChatCompletionRequest):
        refused |= {"logprobs": req.logprobs, "tools": bool(req.tools)}
    else:
        refused |= {"logprobs": req.logprobs is not None, "echo": req.echo}
    for name, bad in refused.items():
        if bad:
            raise bad_request(f"{name} is not supported with use_beam_search (beam search is deterministic and "
                              "answers once the search ends)", name)


def beam_width(req: ChatCompletionRequest | CompletionRequest) -> int:
    """vLLM's width: ``best_of`` when given (completions), else ``n``."""
    best_of = req.best_of if isinstance(req, CompletionRequest) else None
    return max(best_of or req.n, req.n)


def beam_sampling(req: _SamplingFields, width: int, max_tokens: int) -> engine_pb2.SamplingParams:
    """The engine's message for a beam request (temperature left unset: beams are deterministic)."""
    sp = engine_pb2.SamplingParams(max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                                   stop_token_ids=req.stop_token_ids or [], skip_special_tokens=req.skip_special_tokens,
                                   beam_width=width)
    if req.length_penalty is not None:
        sp.length_penalty = req.length_penalty
    if req.early_stopping is not None:
        sp.early_stopping = _EARLY_STOPPING[req.early_stopping]
    if req.top_k is not None and req.top_k > 0:
        sp.top_k = req.top_k
    return sp


def best_hypotheses(final: engine_pb2.GenerateResponse, n: int) -> list[engine_pb2.BeamHypothesis]:
    """The ``n`` best of a finished beam request (fewer when the search found fewer)."""
    return list(final.beams[:n])


def finish_name(h: engine_pb2.BeamHypothesis) -> str:
    return "stop" if h.finish_reason == engine_pb2.FINISH_REASON_STOP else "length"
