"""Scheduling policies of xLLM as pure logic (no torch).

- :mod:`xllm.sched.batch_policy`: the engine's per-step batch policy (decode
  first, chunked prefill under a token budget, preemption choice).
- :mod:`xllm.sched.routing`: global routing across engine instances (round robin,
  least load, KV-cache-aware with session affinity and load-aware fallback).
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
from xllm.sched.routing import (
    InstanceSnapshot,
    KVCacheAwarePolicy,
    LeastLoadPolicy,
    RoundRobinPolicy,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    routing_policy,
    routing_policy_names,
)

__all__ = [
    "BatchPolicy",
    "DecodeFirstPolicy",
    "InstanceSnapshot",
    "KVAllocator",
    "KVCacheAwarePolicy",
    "LeastLoadPolicy",
    "RoundRobinPolicy",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "SchedulableSeq",
    "ScheduledChunk",
    "StepPlan",
    "batch_policy",
    "routing_policy",
    "routing_policy_names",
]
