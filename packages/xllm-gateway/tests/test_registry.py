"""The embedded instance registry: lookup by model, and round-robin routing over what it holds."""

from __future__ import annotations

import collections
import itertools

import pytest

from xllm.gateway.registry import EmbeddedRegistry, NoInstanceError
from xllm.gateway.router import Router
from xllm.proto.registry.v1 import instance_pb2


class Stub:
    def __init__(self, instance_id: str, model: str) -> None:
        self.info = instance_pb2.InstanceInfo(instance_id=instance_id,
                                              model=instance_pb2.ModelInfo(served_name=model))


def test_empty_registry():
    reg = EmbeddedRegistry()
    assert reg.instances() == []
    assert reg.served_models() == []
    assert reg.routable("m") == []
    with pytest.raises(NoInstanceError, match="m"):
        Router(reg, "round_robin").route("m", [1])


def test_instances_by_model_and_served_models():
    reg = EmbeddedRegistry()
    a, b, c = Stub("a", "m1"), Stub("b", "m1"), Stub("c", "m2")
    for s in (a, b, c):
        reg.register(s)
    assert set(map(id, reg.instances())) == {id(a), id(b), id(c)}
    assert reg.instances("m1") == [a, b]
    assert reg.instances("m2") == [c]
    assert reg.instances("m3") == []
    assert reg.served_models() == ["m1", "m2"]


def test_round_robin_is_even():
    reg = EmbeddedRegistry()
    stubs = [Stub(f"i{k}", "m") for k in range(3)]
    for s in stubs:
        reg.register(s)
    reg.register(Stub("other", "x"))
    router = Router(reg, "round_robin")
    picks = [router.route("m", [1, 2, 3]).state.instance_id for _ in range(30)]
    assert collections.Counter(picks) == {"i0": 10, "i1": 10, "i2": 10}
    # consecutive picks never repeat an instance while others are available
    assert all(p != q for p, q in itertools.pairwise(picks))
    assert router.route("x", [1]).state.instance_id == "other"
    with pytest.raises(NoInstanceError):
        router.route("missing", [1])


def test_register_replaces_and_deregister_removes():
    reg = EmbeddedRegistry()
    first, second = Stub("a", "m"), Stub("a", "m")
    reg.register(first)
    reg.register(second)  # same instance id: replaces
    assert reg.instances() == [second]
    reg.deregister("a")
    assert reg.instances() == []
    assert reg.served_models() == []
    reg.deregister("a")  # unknown ids are ignored
    assert reg.routable("m") == []


@pytest.mark.parametrize("policy", ["least_load", "kv_aware"])
def test_online_requests_are_routed_on_online_load_and_offline_ones_accounted_apart(policy):
    """An engine's report carries its offline share (co-location): an online request ignores it, an
    offline one sees everything; the router accounts the offline requests it sends apart too."""
    reg = EmbeddedRegistry()
    for s in (Stub("a", "m"), Stub("b", "m")):
        reg.register(s)
    router = Router(reg, policy)
    reg.get("a").load = instance_pb2.LoadReport(instance_id="a", num_running=12, num_waiting=30, offline_running=10,
                                                offline_waiting=30, pending_prefill_tokens=9000,
                                                offline_pending_prefill_tokens=8800, prefill_tokens_per_s=1000)
    reg.get("b").load = instance_pb2.LoadReport(instance_id="b", num_running=4, num_waiting=1,
                                                pending_prefill_tokens=600, prefill_tokens_per_s=1000)
    assert router.route("m", list(range(200))).state.instance_id == "a"
    offline = router.route("m", list(range(200)), offline=True)
    assert offline.state.instance_id == "b" and offline.offline
    router.dispatched(offline, 1)
    b = reg.get("b")
    assert (b.inflight, b.off_inflight, b.off_pending_prefill, b.off_pending_prompt) == (1, 1, 200, 200)
    snap = router.snapshot(b, 0)
    assert (snap.offline_inflight, snap.offline_pending_prefill_tokens) == (1, 200)
    router.first_token(offline)
    router.finished(offline)
    assert (b.inflight, b.off_inflight, b.off_pending_prefill, b.off_pending_prompt) == (0, 0, 0, 0)


def test_role_loads_carry_the_prompt_sizes_sent_to_each_prefill_instance():
    """Dynamic PD predicts a new request's TTFT from the prompts recently sent to a prefill instance
    (xllm.sched.elastic.SLORoleFlipPolicy.ttft_estimate): the router records the uncached prompt
    tokens of every placement except the decode side's, and the role controller's loads carry their
    mean over the latency window. The decode side's accounting holds the requests, not their prefill."""
    from xllm.gateway.roles import PDRoleOptions, RoleController

    now = [0.0]
    reg = EmbeddedRegistry()
    for iid, role in (("p", instance_pb2.INSTANCE_ROLE_PREFILL), ("d", instance_pb2.INSTANCE_ROLE_DECODE)):
        stub = Stub(iid, "m")
        stub.info.role = role
        reg.register(stub)
    router = Router(reg, "least_load")
    router.latency.clock = lambda: now[0]
    controller = RoleController(reg, router, PDRoleOptions(latency_window_s=10.0), clock=lambda: now[0])
    for n, at in ((300, 0.0), (500, 5.0)):
        now[0] = at
        p_ticket, d_ticket = router.route_pd("m", list(range(n)), 16)
        assert (p_ticket.state.instance_id, d_ticket.state.instance_id) == ("p", "d")
        router.dispatched(d_ticket, 1)
        router.dispatched(p_ticket, 1)
    loads = {x.instance_id: x for x in controller.loads("m")}
    assert loads["p"].recent_prompt_tokens == pytest.approx(400.0) and loads["d"].recent_prompt_tokens == 0.0
    # the decode side of a pair queues no prefill: its prompts are computed on the prefill instance
    assert (reg.get("p").pending_prefill, reg.get("d").pending_prefill, reg.get("d").inflight) == (800, 0, 2)
    assert loads["d"].pending_prefill_tokens == 0
    now[0] = 12.0  # the first placement left the 10 s window
    assert {x.instance_id: x for x in controller.loads("m")}["p"].recent_prompt_tokens == pytest.approx(500.0)


def test_kv_aware_routes_on_the_reported_step_models():
    """What a heartbeat carries for latency prediction reaches the policy (step model times its
    correction, token budget, decode context; xllm.sched.routing): an idle engine whose measured
    prefill rate is low (it only ever saw short prompts) gets the request over a busy one of the same
    model, where the measured rates alone pick the busy one. The role loads carry the decode context."""
    from xllm.gateway.roles import PDRoleOptions, RoleController

    reg = EmbeddedRegistry()
    for s in (Stub("a", "m"), Stub("b", "m")):
        reg.register(s)
    router = Router(reg, "kv_aware")
    coefficients = [0.02, 5.6e-4, 3e-7, 2.1e-6, 1.6e-4]
    predictor = instance_pb2.StepTimePredictor(coefficients=coefficients, correction=1.5, token_budget=512)
    reg.get("a").load = instance_pb2.LoadReport(instance_id="a", num_running=3, decode_context_tokens=1500,
                                                prefill_tokens_per_s=3000)
    reg.get("b").load = instance_pb2.LoadReport(instance_id="b", prefill_tokens_per_s=300)
    assert router.route("m", list(range(220))).state.instance_id == "a"  # no models: the rates decide
    reg.get("a").load.step_predictor.CopyFrom(predictor)
    reg.get("b").load.step_predictor.CopyFrom(predictor)
    snap = router.snapshot(reg.get("a"), 0)
    assert snap.step_model.coefficients == pytest.approx([1.5 * c for c in coefficients])
    assert (snap.token_budget, snap.decode_context_tokens) == (512, 1500)
    assert router.route("m", list(range(220))).state.instance_id == "b"
    for s in ("a", "b"):
        reg.get(s).info.role = instance_pb2.INSTANCE_ROLE_DECODE
    loads = {x.instance_id: x for x in RoleController(reg, router, PDRoleOptions()).loads("m")}
    assert loads["a"].decode_context_tokens == 1500 and loads["a"].step_model == snap.step_model
