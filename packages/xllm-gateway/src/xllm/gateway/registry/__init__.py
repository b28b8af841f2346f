"""Instance registry: which engine instances serve which model, their load and KV contents.

One interface (:class:`Registry`, the gateway's view; publishers for the instances' side),
two backends:

- :class:`EmbeddedRegistry`: the single-machine default, in the gateway process; in-process
  engines are added directly, engine processes register over ``RegistryService`` (gRPC) with
  leases renewed by heartbeats;
- :class:`EtcdRegistry` / :class:`EtcdPublisher`: a real cluster; leased keys under a
  namespace prefix and a watch.
"""

from xllm.gateway.registry.base import InstanceState, NoInstanceError, Registry
from xllm.gateway.registry.embedded import EmbeddedRegistry, RegistryServicer, serve_registry
from xllm.gateway.registry.etcd import DEFAULT_PREFIX, EtcdPublisher, EtcdRegistry
from xllm.gateway.registry.etcd_client import EtcdClient, EtcdError

__all__ = [
    "DEFAULT_PREFIX",
    "EmbeddedRegistry",
    "EtcdClient",
    "EtcdError",
    "EtcdPublisher",
    "EtcdRegistry",
    "InstanceState",
    "NoInstanceError",
    "Registry",
    "RegistryServicer",
    "serve_registry",
]
