"""Instance registry: which engine instances serve which model.

:class:`EmbeddedRegistry` is the single-machine default (in-process, no
network); a cluster registry (etcd) implements the same interface.
"""

from __future__ import annotations

import itertools
import threading

from xllm.gateway.engine_client import EngineClient


class NoInstanceError(LookupError):
    """No live instance serves the requested model."""


class EmbeddedRegistry:
    """In-process registry of engine clients keyed by instance id."""

    def __init__(self) -> None:
        self._clients: dict[str, EngineClient] = {}
        self._lock = threading.Lock()
        self._rr = itertools.count()

    def register(self, client: EngineClient) -> None:
        with self._lock:
            self._clients[client.info.instance_id] = client

    def deregister(self, instance_id: str) -> None:
        with self._lock:
            self._clients.pop(instance_id, None)

    def instances(self, model: str | None = None) -> list[EngineClient]:
        with self._lock:
            clients = list(self._clients.values())
        return [c for c in clients if model is None or c.info.model.served_name == model]

    def served_models(self) -> list[str]:
        return sorted({c.info.model.served_name for c in self.instances()})

    def pick(self, model: str) -> EngineClient:
        """Round-robin over the instances serving ``model``."""
        candidates = self.instances(model)
        if not candidates:
            raise NoInstanceError(f"no instance serves {model!r}")
        return candidates[next(self._rr) % len(candidates)]
