"""The engine service's client side and contract, torch-free.

- :mod:`xllm.engine_api.client`: the :class:`~xllm.engine_api.client.EngineClient` contract and
  :class:`~xllm.engine_api.client.GrpcEngineClient`;
- :mod:`xllm.engine_api.wire`: metadata keys and the one mapping between engine errors and gRPC statuses;
- :mod:`xllm.engine_api.security`: cluster security (token, TLS, the bind policy), both sides;
- :mod:`xllm.engine_api.registration`: registering an instance (agent, publishers, the embedded
  registry's ``RegistryService`` and the etcd key layout and client), both sides of each protocol;
- :mod:`xllm.engine_api.flags`: the engine's command-line flags (``xllm engine``, ``xllm serve``);
- :mod:`xllm.engine_api.names`: the name tables the flags choose from;
- :mod:`xllm.engine_api.bounds`: the API bounds of a request's sampling parameters;
- :mod:`xllm.engine_api.errors`, :mod:`xllm.engine_api.stats`, :mod:`xllm.engine_api.grammar_spec`:
  the engine's errors, its stats and observer types, a request's output constraint.

Nothing here imports torch, the engine runtime (``xllm.core``) or the engine service's server half
(``xllm.engine``): a cluster gateway imports only these (the import-linter contracts check it).
"""
