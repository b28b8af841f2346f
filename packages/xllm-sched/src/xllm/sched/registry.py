"""Policies by name (one table per kind), so engines, routers and the CLI pick them from
configuration; listing the names imports no policy code."""

from __future__ import annotations

from xllm.common import NameRegistry
from xllm.sched.batch_policy import BatchPolicyClass
from xllm.sched.elastic import RolePolicy
from xllm.sched.epd import EPDStrategy
from xllm.sched.routing import RoutingPolicy

BATCH_POLICIES: NameRegistry[BatchPolicyClass] = NameRegistry("batch policy", {
    "colocation": "xllm.sched.colocation:ColocationPolicy",
    "decode_first": "xllm.sched.batch_policy:DecodeFirstPolicy",
})

ROUTING_POLICIES: NameRegistry[type[RoutingPolicy]] = NameRegistry("routing policy", {
    "kv_aware": "xllm.sched.routing:KVCacheAwarePolicy",
    "kv_aware_t0": "xllm.sched.routing:MemoryOnlyKVAwarePolicy",
    "least_load": "xllm.sched.routing:LeastLoadPolicy",
    "round_robin": "xllm.sched.routing:RoundRobinPolicy",
}, normalize=lambda name: name.replace("-", "_"))

PD_POLICIES: NameRegistry[type[RolePolicy]] = NameRegistry("PD role policy", {
    "static": "xllm.sched.elastic:StaticRoles",
    "dynamic": "xllm.sched.elastic:SLORoleFlipPolicy",
})

EPD_STRATEGIES: NameRegistry[EPDStrategy] = NameRegistry("EPD strategy", {
    "ep+d": "xllm.sched.epd:EP_D",
    "e+p+d": "xllm.sched.epd:E_P_D",
    "ed+p": "xllm.sched.epd:ED_P",
}, normalize=str.lower)
