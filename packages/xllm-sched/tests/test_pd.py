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


def test_prefill_overflows_onto_a_decode_instance_only_when_every_prefill_instance_would_miss():
    """With a TTFT objective, a request every prefill candidate is predicted to miss it on runs whole
    on the least loaded decode candidate predicted to meet it; otherwise the usual pair. Oracle: the
    predictions written out with a 1 ms-per-token model (no attention term)."""
    from xllm.sched.latency import StepTimeModel

    model = StepTimeModel((0.0, 0.001, 0.0, 0.0, 0.0))
    placement = PDPlacement(slo_ttft_s=1.0, predictor=model)
    req = RouteRequest(200, max_new_tokens=50)
    busy_p = [snap("p0", pending_prefill_tokens=1500), snap("p1", pending_prefill_tokens=900)]  # 1.7 s, 1.1 s
    decodes = [snap("d0", num_running=9, pending_prefill_tokens=0), snap("d1", num_running=2),
               snap("d2", num_running=1, pending_prefill_tokens=900)]  # d2: 1.1 s, misses too
    assert placement.predicted_ttft(req, busy_p[1]) == pytest.approx(1.1)
    decision = placement.route(req, busy_p, decodes)
    assert decision.local and (decision.prefill.instance_id, decision.prefill.reason) == ("d1", "decode_local")
    # its 200 tokens and, in the same step, its 2 decode rows
    assert decision.decode == decision.prefill and decision.prefill.predicted_latency == pytest.approx(0.202)
    # one prefill instance meets it: no overflow
    ok_p = [*busy_p, snap("p2", pending_prefill_tokens=700)]  # 0.9 s
    decision = placement.route(req, ok_p, decodes)
    assert not decision.local and decision.prefill.instance_id in {"p0", "p1", "p2"}
    # a prefill instance that cannot be predicted (no model, no measured speed): no overflow
    plain = PDPlacement(slo_ttft_s=1.0)
    assert not plain.route(req, [*busy_p, InstanceSnapshot("p3")], decodes).local
    assert plain.route(req, busy_p, decodes).local  # measured speed 1000 tok/s: the same predictions
    # no decode instance meets the objective either, or no objective at all: the usual pair
    assert not placement.route(req, busy_p, [snap("d2", pending_prefill_tokens=900)]).local
    assert not PDPlacement(predictor=model).route(req, busy_p, decodes).local
    with pytest.raises(ValueError):
        PDPlacement(slo_ttft_s=0.0)


def test_predicted_ttft_takes_the_instances_own_model_and_budget():
    from xllm.sched.latency import StepTimeModel

    cluster = StepTimeModel((0.01, 1e-3, 0.0, 0.0, 0.0))
    own = StepTimeModel((0.02, 2e-3, 0.0, 1e-6, 1e-4))
    placement = PDPlacement(predictor=cluster, token_budget=512)
    req = RouteRequest(600)
    plain = snap("d0", num_running=3, pending_prefill_tokens=300)
    # the queued prefills share their steps with the instance's decodes, as the request's own does
    assert placement.predicted_ttft(req, plain) == pytest.approx(
        cluster.queue_seconds(300, 600, 512, 3) + cluster.prefill_seconds(600, 0, 512, 3))
    reported = snap("d1", num_running=3, pending_prefill_tokens=300, step_model=own, token_budget=256,
                    decode_context_tokens=900)
    assert placement.predicted_ttft(req, reported) == pytest.approx(
        own.queue_seconds(300, 600, 256, 3, 900) + own.prefill_seconds(600, 0, 256, 3, 900))
    assert PDPlacement().predicted_ttft(req, reported) == pytest.approx(
        own.queue_seconds(300, 600, 256, 3, 900) + own.prefill_seconds(600, 0, 256, 3, 900))
