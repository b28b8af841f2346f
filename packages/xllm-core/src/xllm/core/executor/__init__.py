"""Tensor parallelism's executor: one engine instance over ``N`` ranks on this host.

Rank 0 is the engine process (scheduler, sampler, service); ranks ``1..N-1`` are worker processes
holding their shard of the model and their own KV memory. Every step's plan goes from rank 0 to the
workers over shared memory (:mod:`~xllm.core.executor.channel`, :mod:`~xllm.core.executor.plan`); every
rank runs the same :meth:`~xllm.core.model_runner.ModelRunner.execute` on it, so every rank calls the
same collectives in the same order; rank 0 alone samples. Rank 0's side:
:class:`~xllm.core.executor.runner.TensorParallelRunner` over a
:class:`~xllm.core.executor.group.RankGroup`; a worker's: :func:`~xllm.core.executor.worker.serve_rank`.
"""

from xllm.core.executor.channel import ChannelSpec, PlanChannel, RankFailed, StepChannel
from xllm.core.executor.group import RankGroup, RankSetup
from xllm.core.executor.net_channel import NetChannelSpec, NetPlanChannel
from xllm.core.executor.runner import TensorParallelRunner
from xllm.core.executor.worker import parent_alive, serve_rank

__all__ = ["ChannelSpec", "NetChannelSpec", "NetPlanChannel", "PlanChannel", "RankFailed", "RankGroup", "RankSetup",
           "StepChannel", "TensorParallelRunner", "parent_alive", "serve_rank"]
