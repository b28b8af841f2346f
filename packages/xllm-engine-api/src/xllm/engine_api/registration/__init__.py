"""Registering an engine instance with the instance registry: both sides of each protocol.

An instance holds a lease, renewed by heartbeats that carry its load, KV cache events and
counters; a gateway watches the registry (its view lives in ``xllm.gateway.registry``).

- :mod:`~xllm.engine_api.registration.agent`: :class:`InstanceAgent` (register, heartbeat every
  interval, re-register on lease loss, deregister) and the :class:`Publisher` contract;
- :mod:`~xllm.engine_api.registration.embedded`: the embedded registry's ``RegistryService`` — the
  servicer a gateway serves over its lease table and the :class:`GrpcRegistryPublisher` engines use;
- :mod:`~xllm.engine_api.registration.etcd`: the etcd key layout and :class:`EtcdPublisher`;
- :mod:`~xllm.engine_api.registration.etcd_client`: the asyncio etcd v3 client both sides use.

No torch is imported here.
"""
