"""Checking a request against an engine's limits before it is queued."""

from __future__ import annotations

from dataclasses import dataclass

from xllm.core.kv.layout import KVCacheLayout
from xllm.core.sampling_params import SamplingParams
from xllm.engine_api.errors import InvalidRequestError
from xllm.proto.engine.v1 import engine_pb2


@dataclass(frozen=True)
class RequestLimits:
    """What an engine can serve: its vocabulary, context length and KV capacity.

    Immutable, so :meth:`check` is safe from any thread (the gRPC and HTTP fronts validate
    before they hand a request to the engine thread).
    """

    vocab_size: int
    max_model_len: int
    layout: KVCacheLayout

    def check(self, req: engine_pb2.GenerateRequest) -> SamplingParams:
        """The request's validated sampling parameters; :class:`InvalidRequestError` names the
        offending parameter otherwise."""
        if not req.request_id:
            raise InvalidRequestError("request_id is required", "request_id")
        params = SamplingParams.from_proto(req.sampling)
        prompt = req.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        resumed = req.resumed_output_tokens
        if resumed >= len(prompt):
            raise InvalidRequestError("resumed_output_tokens must be less than the prompt's length",
                                      "resumed_output_tokens")
        if resumed > params.max_tokens:
            raise InvalidRequestError(f"resumed_output_tokens ({resumed}) exceeds max_tokens ({params.max_tokens})",
                                      "resumed_output_tokens")
        vocab = self.vocab_size
        if vocab and (min(prompt) < 0 or max(prompt) >= vocab):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if vocab and any(not 0 <= t < vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
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
        return params
