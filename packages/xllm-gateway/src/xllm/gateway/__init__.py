"""The xLLM service front: OpenAI-compatible API, dispatch and routing, the registry view,
metrics, and the ``xllm`` CLI that composes them.

- :mod:`xllm.gateway.app`: the FastAPI app (routes, errors, ``/health``, ``/metrics``);
- :mod:`xllm.gateway.openai`: request schemas, chat and completion serving, SSE;
- :mod:`xllm.gateway.dispatch` beside :mod:`xllm.gateway.router`: each request to an instance
  (KV-aware routing policy); its stream asks :mod:`xllm.gateway.failover` (resume or fail) and
  :mod:`xllm.gateway.moves` (drain moves, role-flip hand-overs);
- :mod:`xllm.gateway.registry`: the live view of engine instances (embedded or etcd);
- :mod:`xllm.gateway.metrics`: Prometheus metrics;
- composition: :mod:`xllm.gateway.embedded` (one process with its engine) and
  :mod:`xllm.gateway.cluster` (a gateway over engine processes; imports no torch);
- :mod:`xllm.gateway.cli`: ``xllm serve`` and ``xllm engine``.

The engine side of the service boundary (engine process, gRPC server and clients, registration)
is the ``xllm-engine`` package (:mod:`xllm.engine`).
"""
