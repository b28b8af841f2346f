"""The engine as a service: one home for both sides of ``xllm.engine.v1.EngineService``.

Server side (imports torch and the engine runtime):

- :mod:`xllm.engine.instance`: the engine process (``xllm engine`` / ``python -m xllm.engine``):
  load, serve, register, drain and hand back on shutdown;
- :mod:`xllm.engine.loader`: resolve and load a model and build its engine on a compute thread;
- :mod:`xllm.engine.server`: :class:`~xllm.engine.server.EngineServer`, the gRPC servicer.

Client side and wire (no torch: a cluster gateway imports only these):

- :mod:`xllm.engine.wire`: metadata keys and the one mapping between engine errors and gRPC statuses;
- :mod:`xllm.engine.client`: the :class:`~xllm.engine.client.EngineClient` contract and
  :class:`~xllm.engine.client.GrpcEngineClient`;
- :mod:`xllm.engine.registration`: registering an instance (agent, publishers, the embedded
  registry's ``RegistryService`` and the etcd key layout) — both sides of each registry protocol;
- :mod:`xllm.engine.flags`: the engine's command-line flags (shared with ``xllm serve``).

:mod:`xllm.engine.inprocess` is the client of an engine living in the caller's process.
"""
