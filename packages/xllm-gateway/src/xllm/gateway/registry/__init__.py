"""The gateway's view of the instance registry: which engine instances serve which model, their
load and KV contents.

One view (:class:`Registry`), two backends; the instances' side of each backend is in
:mod:`xllm.engine_api.registration`:

- :class:`EmbeddedRegistry`: the single-machine default, in the gateway process; in-process
  engines are added directly, engine processes register over ``RegistryService`` (gRPC) with
  leases renewed by heartbeats;
- :class:`EtcdRegistry`: a real cluster; a watch over leased keys under a namespace prefix.
"""

from xllm.gateway.registry.base import InstanceState, NoInstanceError, Registry
from xllm.gateway.registry.embedded import EmbeddedRegistry
from xllm.gateway.registry.etcd import EtcdRegistry

__all__ = [
    "EmbeddedRegistry",
    "EtcdRegistry",
    "InstanceState",
    "NoInstanceError",
    "Registry",
]
