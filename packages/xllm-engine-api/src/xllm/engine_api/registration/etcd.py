"""The etcd registry backend's layout and its instance side.

Layout under ``PREFIX`` (default ``/xllm``), values are serialized protobuf messages:

- ``PREFIX/instances/ID``  -> ``xllm.registry.v1.InstanceInfo``, written once per registration
- ``PREFIX/heartbeats/ID`` -> ``xllm.registry.v1.Heartbeat``, rewritten every heartbeat

Both keys hang on the instance's lease (TTL 3 s by default). The instance renews the lease and
rewrites its heartbeat every interval (0.5 s); when it stops (kill -9, a partition) etcd expires
the lease and deletes both keys, and every gateway's watch sees the deletion. A clean shutdown
revokes the lease first, so gateways stop routing to it at once. The gateway side (the watch) is
``xllm.gateway.registry.EtcdRegistry``, reading the same :class:`EtcdLayout`.

etcd down, frozen or restarted: every call times out or fails (the agent retries at the next
interval, the engine keeps serving). etcd restarted on its data dir keeps the lease (etcd renews
every lease when a leader is elected), so the next keepalive succeeds and nothing changes; etcd
restarted without its data, or a lease that expired meanwhile (etcd frozen for longer than the
TTL expires every lease as it resumes), answers the keepalive with TTL 0 and the agent registers
again under a new lease, starting with a snapshot of its KV cache.

Trust: with a cluster token, the info key's value is signed for the lease it hangs on; a gateway
with the token ignores an info key that is unsigned, signed with another credential, or found
under another lease (a stale record written again), and heartbeat keys not under the lease of
their instance's verified record. Heartbeats are signed too (:func:`~xllm.engine_api.credential.sign_heartbeat`,
for the lease, with their seq): a writer who reads the live lease can neither forge one (load, KV events,
draining) nor write an old one again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from xllm.engine_api.credential import sign_heartbeat, sign_record
from xllm.engine_api.registration.embedded import DEFAULT_TTL
from xllm.engine_api.registration.etcd_client import EtcdClient, EtcdLeaseNotFound
from xllm.engine_api.security import NO_SECURITY, ClusterSecurity
from xllm.proto.registry.v1 import instance_pb2

DEFAULT_PREFIX = "/xllm"


@dataclass(frozen=True)
class EtcdLayout:
    """The keys of a registry namespace ``prefix``."""

    prefix: str = DEFAULT_PREFIX

    @property
    def base(self) -> str:
        return self.prefix.rstrip("/") + "/"

    @property
    def instances(self) -> str:
        return self.base + "instances/"

    @property
    def heartbeats(self) -> str:
        return self.base + "heartbeats/"


class EtcdPublisher:
    """An instance's side of the etcd backend: lease, info key, heartbeat key. With a cluster token in
    ``security`` the info and every heartbeat are signed for the lease they are written under
    (:func:`xllm.engine_api.credential.sign_record`, :func:`~xllm.engine_api.credential.sign_heartbeat`):
    gateways with the token accept nothing else."""

    def __init__(self, etcd: EtcdClient, prefix: str = DEFAULT_PREFIX, ttl: float = DEFAULT_TTL,
                 security: ClusterSecurity = NO_SECURITY) -> None:
        self.etcd = etcd
        self.security = security
        self.prefix = prefix
        self.ttl = ttl
        self.layout = EtcdLayout(prefix)
        self.lease: int | None = None
        self._instance_id = ""

    async def register(self, info: instance_pb2.InstanceInfo) -> None:
        lease, _ = await self.etcd.grant(self.ttl)
        try:
            if self.security.keys is not None:
                info = sign_record(self.security.keys, info, lease)
            await self.etcd.put(self.layout.instances + info.instance_id, info.SerializeToString(), lease)
        except BaseException:
            with contextlib.suppress(Exception):  # etcd may be gone: the lease then expires by itself
                await self.etcd.revoke(lease)
            raise
        self.lease, self._instance_id = lease, info.instance_id

    async def heartbeat(self, hb: instance_pb2.Heartbeat) -> bool:
        """Renew the lease and rewrite the heartbeat key; False when etcd no longer knows the lease
        (expired, or etcd lost its data); an :class:`~xllm.engine_api.registration.etcd_client.EtcdError`
        or an httpx error when etcd cannot be reached."""
        if self.lease is None:
            return False
        try:
            if await self.etcd.keepalive(self.lease) <= 0:
                self.lease = None
                return False
            if self.security.keys is not None:
                hb = sign_heartbeat(self.security.keys, hb, self.lease)
            await self.etcd.put(self.layout.heartbeats + self._instance_id, hb.SerializeToString(), self.lease)
        except EtcdLeaseNotFound:
            self.lease = None
            return False
        return True

    async def deregister(self) -> None:
        if self.lease is not None:
            lease, self.lease = self.lease, None
            await self.etcd.revoke(lease)

    async def close(self) -> None:
        await self.etcd.close()

    def describe(self) -> str:
        return f"etcd {','.join(self.etcd.endpoints)} {self.prefix}"
