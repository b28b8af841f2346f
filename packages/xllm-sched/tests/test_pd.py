"""PD placement: the decode instance by room, prefix and load; the prefill instance by its policy."""

from __future__ import annotations

import pytest

from xllm.sched import InstanceSnapshot, PDPlacement, RoundRobinPolicy, RouteRequest


def snap(iid: str, **kw) -> InstanceSnapshot:
    kw.setdefault("prefill_tokens_per_s", 1000.0)
    return InstanceSnapshot(iid, **kw)


def test_decode_prefers_the_prefix_holder_with_room():
    placement = PDPlacement()
    req = RouteRequest(1000, max_new_tokens=200)
    decodes = [snap("d0", matched_tokens=800, kv_free_tokens=5000), snap("d1", kv_free_tokens=9000)]
    decision = placement.route(req, [snap("p0")], decodes)
    assert (decision.decode.instance_id, decision.decode.reason) == ("d0", "decode_prefix")
    assert decision.prefill.instance_id == "p0"
    # no room for prompt + output on the prefix holder: the other one
    decodes = [snap("d0", matched_tokens=800, kv_free_tokens=1100), snap("d1", kv_free_tokens=9000)]
    assert placement.route(req, [snap("p0")], decodes).decode.instance_id == "d1"
    # nobody has room: still a choice (the engine queues the reservation)
    decodes = [snap("d0", kv_free_tokens=10), snap("d1", kv_free_tokens=20)]
    assert placement.decode(req, decodes).reason == "decode_full"


def test_decode_spreads_load_when_no_prefix_is_held():
    placement = PDPlacement()
    req = RouteRequest(100, max_new_tokens=10)
    decodes = [snap("d0", num_running=6), snap("d1", num_running=1, inflight=2), snap("d2", num_running=3)]
    assert placement.decode(req, decodes).instance_id == "d1"
    assert placement.decode(req, decodes).reason == "decode_load"
    # unknown room (no heartbeat yet) counts as room
    assert placement.decode(req, [snap("d0", kv_free_tokens=-1)]).instance_id == "d0"


def test_prefill_goes_through_its_policy():
    placement = PDPlacement(prefill_policy=RoundRobinPolicy())
    picks = [placement.route(RouteRequest(10), [snap("p0"), snap("p1")], [snap("d0")]).prefill.instance_id
             for _ in range(4)]
    assert sorted(picks) == ["p0", "p0", "p1", "p1"]
    with pytest.raises(ValueError):
        placement.route(RouteRequest(10), [], [snap("d0")])
