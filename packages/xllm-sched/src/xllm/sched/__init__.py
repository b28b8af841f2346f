"""Scheduling policies of xLLM as pure logic (no torch).

- :mod:`xllm.sched.batch_policy`: the engine's per-step batch policy (decode
  first, chunked prefill under a token budget, preemption choice), deciding over
  the engine scheduler's queues (:class:`SchedulerQueues`).
- :mod:`xllm.sched.colocation`: online/offline co-location as a batch policy (offline work in
  what online work leaves, within the TPOT SLO by prediction; preempted for online requests;
  starvation bounded).
- :mod:`xllm.sched.encode`: the encode phase of multimodal requests in a step (which images, how
  many per step: the start-up profile's search).
- :mod:`xllm.sched.routing`: global routing across engine instances (round robin,
  least load, KV-cache-aware with session affinity and load-aware fallback).
- :mod:`xllm.sched.pd`: placement for prefill/decode disaggregation (a decode instance, then a
  prefill instance).
- :mod:`xllm.sched.moves`: moving a running request off an instance: KV migration or recompute,
  chosen by predicted cost.
- :mod:`xllm.sched.elastic`: dynamic PD roles: which prefill/decode instance flips role, by SLO
  headroom with hysteresis and cool-downs.
- :mod:`xllm.sched.epd`: hybrid EPD disaggregation: where images are encoded (``ep+d``, ``e+p+d``,
  ``ed+p``) and the profiler's model that ranks layouts of instances for a workload.
- :mod:`xllm.sched.registry`: policies by name (:data:`BATCH_POLICIES`, :data:`ROUTING_POLICIES`,
  :data:`PD_POLICIES`, :data:`EPD_STRATEGIES`).
"""

from xllm.sched.batch_policy import (
    DEFAULT_OFFLINE_SLO_FRACTION,
    BatchPolicy,
    BatchSettings,
    DecodeFirstPolicy,
    SchedulableSeq,
    ScheduledChunk,
    SchedulerQueues,
    StepPlan,
)
from xllm.sched.colocation import ColocationPolicy
from xllm.sched.elastic import RoleFlip, RoleLoad, RolePolicy, SLORoleFlipPolicy, StaticRoles
from xllm.sched.moves import MOVE_MODES, MoveCost, RateEstimate, move_cost
from xllm.sched.pd import PDDecision, PDPlacement
from xllm.sched.registry import BATCH_POLICIES, EPD_STRATEGIES, PD_POLICIES, ROUTING_POLICIES
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
    "DEFAULT_OFFLINE_SLO_FRACTION",
    "EPD_STRATEGIES",
    "MOVE_MODES",
    "PD_POLICIES",
    "ROUTING_POLICIES",
    "BatchPolicy",
    "BatchSettings",
    "ColocationPolicy",
    "DecodeFirstPolicy",
    "InstanceSnapshot",
    "KVCacheAwarePolicy",
    "LeastLoadPolicy",
    "MoveCost",
    "PDDecision",
    "PDPlacement",
    "RateEstimate",
    "RoleFlip",
    "RoleLoad",
    "RolePolicy",
    "RoundRobinPolicy",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "SLORoleFlipPolicy",
    "SchedulableSeq",
    "ScheduledChunk",
    "SchedulerQueues",
    "StaticRoles",
    "StepPlan",
    "move_cost",
]
