"""Policies by name, so engines and routers pick them from configuration."""

from __future__ import annotations

from collections.abc import Callable

from xllm.sched.batch_policy import BatchPolicy, DecodeFirstPolicy
from xllm.sched.routing import routing_policy, routing_policy_names

_BATCH_POLICIES: dict[str, Callable[..., BatchPolicy]] = {
    "decode_first": DecodeFirstPolicy,
}


def batch_policy(name: str, **kwargs) -> BatchPolicy:
    """Build the batch policy called ``name``; unknown names list the known ones."""
    try:
        factory = _BATCH_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown batch policy {name!r}; known: {sorted(_BATCH_POLICIES)}") from None
    return factory(**kwargs)


__all__ = ["batch_policy", "routing_policy", "routing_policy_names"]
