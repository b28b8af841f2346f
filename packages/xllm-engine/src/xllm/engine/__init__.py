"""The engine as a service: the server half of ``xllm.engine.v1.EngineService`` (imports torch and
the engine runtime).

- :mod:`xllm.engine.instance`: the engine process (``xllm engine`` / ``python -m xllm.engine``):
  load, serve, register, drain and hand back on shutdown;
- :mod:`xllm.engine.loader`: resolve and load a model and build its engine on a compute thread;
- :mod:`xllm.engine.config`: the engine's settings (``EngineConfig``, hand-off options) from its flags;
- :mod:`xllm.engine.server`: :class:`~xllm.engine.server.EngineServer`, the gRPC servicer;
- :mod:`xllm.engine.handoff`: KV hand-offs between instances and migrations;
- :mod:`xllm.engine.inprocess`: the client of an engine living in the caller's process;
- :mod:`xllm.engine.profiler`: ``xllm profile``.

The client side and the contract (gRPC client, wire, security, registration, the flags) are
torch-free and live in :mod:`xllm.engine_api`; a cluster gateway imports only those.
"""
