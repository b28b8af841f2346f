"""Signed heartbeats (issue 50, item 1): with a cluster token, a heartbeat changes an instance's load,
KV index entries or draining state only when its instance's registration wrote it.

An attacker who can write to etcd reads the live lease of a real instance and writes heartbeats under
it: unsigned, signed with another credential, a captured signed one written again (an old seq), and one
signed for another lease. None is applied (the load, the KV index and the draining flag stay those of the
real heartbeats), each is counted by reason; the real instance's next heartbeat still applies. The same
for the embedded registry's ``Heartbeat`` with a known lease id.
"""

from __future__ import annotations

import asyncio
import secrets

from prometheus_client import CollectorRegistry

from xllm.engine_api.credential import ClusterKeys, sign_heartbeat, sign_record
from xllm.engine_api.registration.etcd import EtcdLayout, EtcdPublisher
from xllm.engine_api.registration.etcd_client import EtcdClient
from xllm.engine_api.security import ClusterSecurity
from xllm.gateway.metrics import RegistryMetrics
from xllm.gateway.registry import EmbeddedRegistry, EtcdRegistry
from xllm.proto.kvstore.v1 import kv_events_pb2
from xllm.proto.registry.v1 import instance_pb2
from xllm.testing.processes import until

SECURITY = ClusterSecurity(token=secrets.token_urlsafe(32))
OTHER = ClusterKeys.from_token(secrets.token_urlsafe(32))
PREFIX = "/hbtrust"
REFUSED = {"heartbeat_unsigned": 1, "heartbeat_bad_signature": 1, "heartbeat_replayed": 1,
           "heartbeat_wrong_lease": 1}


def info(iid: str) -> instance_pb2.InstanceInfo:
    return instance_pb2.InstanceInfo(instance_id=iid, address="127.0.0.1:1", role=instance_pb2.INSTANCE_ROLE_MIXED,
                                     model=instance_pb2.ModelInfo(served_name="tiny", block_size=16,
                                                                  max_model_len=64))


def beat(iid: str, seq: int, running: int, draining: bool = False, block: int = 0) -> instance_pb2.Heartbeat:
    """A heartbeat reporting ``running`` requests; with ``block``, a KV snapshot holding that block hash."""
    hb = instance_pb2.Heartbeat(instance_id=iid, seq=seq, draining=draining,
                                load=instance_pb2.LoadReport(instance_id=iid, num_running=running))
    if block:
        hb.kv_events.CopyFrom(kv_events_pb2.KVCacheEvents(instance_id=iid, block_size=16, epoch=7, version=seq,
                                                          snapshot=True, stored=[block]))
    return hb


def forgeries(iid: str, captured: instance_pb2.Heartbeat, lease: int) -> list[instance_pb2.Heartbeat]:
    """What an attacker who holds the lease id (and a captured heartbeat) can write: each would drain the
    instance, report it overloaded and claim a KV block it does not hold."""
    return [beat(iid, 100, 999, draining=True, block=666),                                # unsigned
            sign_heartbeat(OTHER, beat(iid, 100, 999, draining=True, block=666), lease),  # another credential
            captured,                                                                     # an old seq again
            sign_heartbeat(SECURITY.keys, beat(iid, 100, 999, draining=True), lease + 1)]  # for another lease


def assert_untouched(state, running: int) -> None:
    assert not state.draining and state.load.num_running == running



def test_forged_and_replayed_heartbeats_in_etcd_change_nothing(etcd):
    async def main():
        metrics = RegistryMetrics(CollectorRegistry())
        registry = EtcdRegistry(EtcdClient(etcd.endpoint), PREFIX, metrics=metrics, credential=SECURITY.keys)
        publisher = EtcdPublisher(EtcdClient(etcd.endpoint), PREFIX, 10.0, security=SECURITY)
        attacker = EtcdClient(etcd.endpoint)
        key = EtcdLayout(PREFIX).heartbeats + "real"
        try:
            await registry.start()
            await registry.wait_synced(10)
            await publisher.register(info("real"))
            assert await publisher.heartbeat(beat("real", 1, 1, block=11))
            await until(lambda: registry.get("real") is not None and registry.get("real").heartbeats == 1, 10,
                        "the first heartbeat applied")
            _, kvs = await attacker.get_prefix(key)  # the attacker reads the live lease and a signed heartbeat
            lease, captured = kvs[0].lease, instance_pb2.Heartbeat.FromString(kvs[0].value)
            assert captured.signature.lease == lease and lease == publisher.lease
            assert await publisher.heartbeat(beat("real", 2, 2, block=11))
            for forged in forgeries("real", captured, lease):
                await attacker.put(key, forged.SerializeToString(), lease)
            assert await publisher.heartbeat(beat("real", 3, 3, block=11))  # written after every forgery
            await until(lambda: registry.get("real").load.num_running == 3, 10, "the real third heartbeat applied")
            state = registry.get("real")
            return (state.heartbeats, state, dict(registry.refused_records),
                    metrics.refused.labels("heartbeat_replayed")._value.get(),
                    registry.kv_index.holders(11), registry.kv_index.holders(666))
        finally:
            await publisher.deregister()
            await publisher.close()
            await registry.close()
            await attacker.close()

    applied, state, refused, counted, real_block, forged_block = asyncio.run(main())
    assert applied == 3  # the three real heartbeats, none of the four forgeries
    assert_untouched(state, 3)
    assert refused == REFUSED and counted == 1
    assert real_block == {"real"} and forged_block == frozenset()


def test_forged_and_replayed_heartbeats_in_the_embedded_registry_change_nothing():
    registry = EmbeddedRegistry(credential=SECURITY.keys)
    lease, _ = registry.grant(sign_record(SECURITY.keys, info("real")), 10)
    first = sign_heartbeat(SECURITY.keys, beat("real", 1, 1), lease)
    assert registry.keepalive(lease, first)
    assert registry.keepalive(lease, sign_heartbeat(SECURITY.keys, beat("real", 2, 2), lease))
    answers = [registry.keepalive(lease, forged) for forged in forgeries("real", first, lease)]
    state = registry.get("real")
    assert answers == [False] * 4 and state.heartbeats == 2
    assert_untouched(state, 2)
    assert registry.refused_records == REFUSED
    assert registry.keepalive(lease, sign_heartbeat(SECURITY.keys, beat("real", 3, 3), lease))
    assert_untouched(state, 3)
