"""Scheduling policies of xLLM as pure logic (no torch).

- :mod:`xllm.sched.batch_policy`: the engine's per-step batch policy (decode
  first, chunked prefill under a token budget, preemption choice), deciding over
  the engine scheduler's queues (:class:`SchedulerQueues`).
- :mod:`xllm.sched.routing`: global routing across engine instances (round robin,
  least load, KV-cache-aware with session affinity and load-aware fallback).
- :mod:`xllm.sched.pd`: placement for prefill/decode disaggregation (a decode instance, then a
  prefill instance).
- :mod:`xllm.sched.moves`: moving a running request off an instance: KV migration or recompute,
  chosen by predicted cost.
- :mod:`xllm.sched.registry`: policies by name (:data:`BATCH_POLICIES`, :data:`ROUTING_POLICIES`).
"""

from xllm.sched.batch_policy import (
    BatchPolicy,
    DecodeFirstPolicy,
    SchedulableSeq,
    ScheduledChunk,
    SchedulerQueues,
    StepPlan,
)
from xllm.sched.moves import MOVE_MODES, MoveCost, RateEstimate, move_cost
from xllm.sched.pd import PDDecision, PDPlacement
from xllm.sched.registry import BATCH_POLICIES, ROUTING_POLICIES
from xllm.sched.routing import (
    InstanceSnapshot,
    KVCacheAwarePolicy,
    LeastLoadPolicy,
    RoundRobinPolicy,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
)

__all__ = [
    "BATCH_POLICIES",
    "MOVE_MODES",
    "ROUTING_POLICIES",
    "BatchPolicy",
    "DecodeFirstPolicy",
    "InstanceSnapshot",
    "KVCacheAwarePolicy",
    "LeastLoadPolicy",
    "MoveCost",
    "PDDecision",
    "PDPlacement",
    "RateEstimate",
    "RoundRobinPolicy",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "SchedulableSeq",
    "ScheduledChunk",
    "SchedulerQueues",
    "StepPlan",
    "move_cost",
]
