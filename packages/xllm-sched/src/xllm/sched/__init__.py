"""Scheduling policies of xLLM as pure logic (no torch).

- :mod:`xllm.sched.batch_policy`: the engine's per-step batch policy (decode
  first, chunked prefill under a token budget, preemption choice).
- :mod:`xllm.sched.registry`: policies by name.
"""

from xllm.sched.batch_policy import (
    BatchPolicy,
    DecodeFirstPolicy,
    KVAllocator,
    SchedulableSeq,
    ScheduledChunk,
    StepPlan,
)
from xllm.sched.registry import batch_policy

__all__ = [
    "BatchPolicy",
    "DecodeFirstPolicy",
    "KVAllocator",
    "SchedulableSeq",
    "ScheduledChunk",
    "StepPlan",
    "batch_policy",
]
