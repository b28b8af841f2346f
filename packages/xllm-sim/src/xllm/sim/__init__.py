"""A discrete-event simulator of an xLLM cluster (no torch): a gateway and N engine instances in
which the real ``xllm.sched`` policies make every decision — routing, PD placement, the engine's
batch policy (co-location included), role flips — while step times come from a
:class:`xllm.sched.latency.StepTimeModel` fitted on this engine's ``xllm profile`` output.

- :mod:`xllm.sim.trace`: requests (Poisson, Gamma, Azure LLM inference trace CSV).
- :mod:`xllm.sim.kvcache`: an instance's KV blocks and prefix cache.
- :mod:`xllm.sim.instance`: an engine instance (the scheduler's queues, steps).
- :mod:`xllm.sim.gateway`: the gateway's view of the instances, the routing policy's inputs.
- :mod:`xllm.sim.cluster`: the event loop, dispatch, PD hand-offs.
- :mod:`xllm.sim.roles`: role flips and the moves they cause.
- :mod:`xllm.sim.metrics`: per-request records and the report.
- :mod:`xllm.sim.profile`: the default step-time profile.
- :mod:`xllm.sim.moe`: expert-parallel load per rank and EPLB (the policies of :mod:`xllm.sched.eplb`).
- :mod:`xllm.sim.cli`: ``xllm-sim``.
"""

from xllm.sim.cluster import Cluster, make_batch_policy
from xllm.sim.config import SimConfig
from xllm.sim.profile import DEFAULT_PROFILE, load_model
from xllm.sim.trace import LengthDist, RequestSpec, TraceError, Workload, load_trace, parse_trace, synthetic

__all__ = [
    "DEFAULT_PROFILE",
    "Cluster",
    "LengthDist",
    "RequestSpec",
    "SimConfig",
    "TraceError",
    "Workload",
    "load_model",
    "load_trace",
    "make_batch_policy",
    "parse_trace",
    "synthetic",
]
