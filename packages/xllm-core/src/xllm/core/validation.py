"""Checking a request against an engine's limits before it is queued.

The checks run cheapest first: the counts of the repeated fields (``len``, constant time) and the
sizes of the few strings they bound, then the conversion into :class:`SamplingParams`, and only
then the per-token range checks, over at most ``max_model_len`` tokens. The request limits are the
gateway's (:class:`~xllm.engine_api.bounds.RequestBounds`, defined once in
:mod:`xllm.engine_api.bounds`): a peer that bypasses the gateway gets the same refusals, each an
:class:`InvalidRequestError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xllm.core.kv.layout import KVCacheLayout
from xllm.core.sampling_params import SamplingParams
from xllm.engine_api.bounds import RequestBounds
from xllm.engine_api.errors import InvalidRequestError
from xllm.proto.engine.v1 import engine_pb2


def _at_most(param: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise InvalidRequestError(f"{param}: {count} {what}; this engine accepts at most {limit}", param)


def check_sizes(req: engine_pb2.GenerateRequest, max_model_len: int, bounds: RequestBounds) -> None:
    """The size checks of ``req`` that cost no per-token work: the prompt's length against the
    context, the counts of stop strings, stop token ids and ``logit_bias`` entries, the longest stop
    string and the output constraint's characters (:class:`InvalidRequestError` naming the field)."""
    n = len(req.prompt_token_ids)
    if not n:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if n > max_model_len:  # even a resumed request's prompt (with its earlier output) fits the context
        raise InvalidRequestError(f"the prompt has {n} tokens but the context length is {max_model_len}", "prompt")
    s = req.sampling
    _at_most("stop", len(s.stop), bounds.max_stop, "stop sequences")
    _at_most("stop_token_ids", len(s.stop_token_ids), bounds.max_stop_token_ids, "stop token ids")
    _at_most("logit_bias", len(s.logit_bias), bounds.max_logit_bias, "logit_bias entries")
    longest = max(map(len, s.stop), default=0)
    if longest > bounds.max_stop_chars:
        raise InvalidRequestError(f"stop: a stop sequence has {longest} characters; this engine accepts at most "
                                  f"{bounds.max_stop_chars}", "stop")
    if s.HasField("structured"):
        constraint = s.structured
        kind = constraint.WhichOneof("constraint")
        if kind == "choice":  # counted as the gateway counts its JSON array: at least 4 characters a choice more
            values = constraint.choice.values
            _at_most(constraint.field or "structured", len(values), bounds.max_grammar_chars // 4, "choices")
            chars = sum(map(len, values)) + 4 * len(values)
        else:
            chars = len(getattr(constraint, kind)) if kind else 0
        if chars > bounds.max_grammar_chars:
            param = constraint.field or "structured"
            raise InvalidRequestError(f"{param}: the constraint holds {chars} characters; this engine accepts at "
                                      f"most {bounds.max_grammar_chars}", param)


@dataclass(frozen=True)
class RequestLimits:
    """What an engine can serve: its vocabulary, context length and KV capacity, and the request
    bounds it shares with the gateway (``bounds``).

    Immutable, so :meth:`check` is safe from any thread (the gRPC and HTTP fronts validate
    before they hand a request to the engine thread).
    """

    vocab_size: int
    max_model_len: int
    layout: KVCacheLayout
    bounds: RequestBounds = field(default_factory=RequestBounds)
    image_token_bytes: int = 0  # a multimodal model's pixel bytes per image token (0: a text model)

    def check(self, req: engine_pb2.GenerateRequest) -> SamplingParams:
        """The request's validated sampling parameters; :class:`InvalidRequestError` names the
        offending parameter otherwise. Cheapest checks first (see the module docstring)."""
        if not req.request_id:
            raise InvalidRequestError("request_id is required", "request_id")
        check_sizes(req, self.max_model_len, self.bounds)
        params = SamplingParams.from_proto(req.sampling)
        prompt = req.prompt_token_ids
        resumed = req.resumed_output_tokens
        if resumed >= len(prompt):
            raise InvalidRequestError("resumed_output_tokens must be less than the prompt's length",
                                      "resumed_output_tokens")
        if resumed > params.max_tokens:
            raise InvalidRequestError(f"resumed_output_tokens ({resumed}) exceeds max_tokens ({params.max_tokens})",
                                      "resumed_output_tokens")
        # A resumed request's earlier output (the last `resumed` prompt tokens) counts against max_tokens.
        prompt_len = len(prompt) - resumed
        if prompt_len >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {prompt_len} tokens but the context length is {self.max_model_len}", "prompt")
        if prompt_len + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"length {self.max_model_len}", "max_tokens")
        # A sequence that cannot fit the whole KV pool on its own would be preempted and
        # re-admitted forever (the engine would never finish it): reject it up front.
        capacity = self.layout.capacity_tokens
        if self.layout.blocks_for(prompt_len + params.max_tokens) > self.layout.num_blocks:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({params.max_tokens}) exceeds the KV cache "
                f"capacity of {capacity} tokens", "prompt" if prompt_len > capacity else "max_tokens")
        vocab = self.vocab_size  # the per-token checks last, over at most max_model_len tokens
        if vocab and any(not 0 <= t < vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        if vocab and (min(prompt) < 0 or max(prompt) >= vocab):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        return params
