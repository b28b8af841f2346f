"""The API bounds of a request's sampling parameters: what the engine accepts
(:class:`xllm.core.sampling_params.SamplingParams` checks them) and what the gateway refuses
with a 400 before it submits."""

from __future__ import annotations

MAX_TOP_LOGPROBS = 20
MIN_TEMPERATURE = 1e-2  # a positive temperature below this is raised to it (vLLM's floor): 1/T overflows below
MAX_REPETITION_PENALTY = 100.0
MAX_BEAM_WIDTH = 1024  # beams of one request (xllm.core.beam; xLLM's recommendation design goes to 512)
