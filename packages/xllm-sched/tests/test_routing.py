"""Routing policies over instance snapshots (pure Python, no torch)."""

from __future__ import annotations

import collections
import subprocess
import sys
from dataclasses import replace

import pytest

from xllm.common import UnknownNameError
from xllm.sched import (
    ROUTING_POLICIES,
    InstanceSnapshot,
    KVCacheAwarePolicy,
    LeastLoadPolicy,
    RoundRobinPolicy,
    RouteRequest,
)
from xllm.sched.latency import StepTimeModel, mean_model


def snap(iid: str, **kw) -> InstanceSnapshot:
    kw.setdefault("prefill_tokens_per_s", 1000.0)
    return InstanceSnapshot(iid, **kw)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_policies_by_name():
    assert ROUTING_POLICIES.names() == ["kv_aware", "kv_aware_t0", "least_load", "round_robin"]
    assert isinstance(ROUTING_POLICIES.create("round_robin"), RoundRobinPolicy)
    assert isinstance(ROUTING_POLICIES.create("least-load"), LeastLoadPolicy)
    assert ROUTING_POLICIES.create("kv_aware", alpha=2.0).alpha == 2.0
    with pytest.raises(UnknownNameError, match="known"):
        ROUTING_POLICIES.create("random")


@pytest.mark.parametrize("name", ["round_robin", "least_load", "kv_aware"])
def test_no_candidates_is_an_error(name):
    with pytest.raises(ValueError):
        ROUTING_POLICIES.create(name).route(RouteRequest(10), [])


@pytest.mark.parametrize("name", ["round_robin", "least_load", "kv_aware"])
def test_single_candidate_is_chosen(name):
    assert ROUTING_POLICIES.create(name).route(RouteRequest(10), [snap("a", num_waiting=500)]).instance_id == "a"


def test_round_robin_is_even_whatever_the_order():
    p = RoundRobinPolicy()
    cands = [snap("b"), snap("a"), snap("c")]
    picks = [p.route(RouteRequest(5), cands[::(-1) ** k]).instance_id for k in range(30)]
    assert collections.Counter(picks) == {"a": 10, "b": 10, "c": 10}
    assert picks[:3] == ["a", "b", "c"]


def test_least_load_uses_the_larger_of_reported_and_inflight():
    p = LeastLoadPolicy()
    cands = [snap("a", num_running=1, num_waiting=1), snap("b", inflight=3), snap("c", num_running=2, inflight=1)]
    assert p.route(RouteRequest(5), cands).instance_id in {"a", "c"}
    cands = [snap("a", num_running=2, kv_usage=0.5), snap("b", num_running=2, kv_usage=0.1)]
    assert p.route(RouteRequest(5), cands).reason == "least_load"
    assert p.route(RouteRequest(5), cands).instance_id == "b"
    # equal loads rotate
    picks = {p.route(RouteRequest(5), [snap("a"), snap("b")]).instance_id for _ in range(4)}
    assert picks == {"a", "b"}


def test_kv_aware_prefers_the_instance_holding_the_prefix():
    p = KVCacheAwarePolicy()
    d = p.route(RouteRequest(1000), [snap("a"), snap("b", matched_tokens=900), snap("c", matched_tokens=200)])
    assert (d.instance_id, d.reason) == ("b", "kv_cache")
    assert d.scores["b"] > d.scores["c"] > d.scores["a"]
    # the latency of a cached request is that of its uncached tail
    assert d.predicted_latency == pytest.approx(0.1)


def test_kv_aware_defaults_trade_a_somewhat_slower_prefix_holder_for_its_cache():
    """With the settings a user gets (``--routing kv_aware``, nothing else), an instance holding 900 of
    the prompt's 1000 tokens wins over an idle one without them although its queue makes it predicted
    somewhat slower (1.2 s against 1.0 s: within the fallback ratio), through the cache-reuse term."""
    for policy in (KVCacheAwarePolicy(), ROUTING_POLICIES.create("kv_aware")):
        idle, holder = snap("a"), snap("b", matched_tokens=900, pending_prefill_tokens=1100)
        d = policy.route(RouteRequest(1000), [idle, holder])
        assert d.predicted_latency == pytest.approx(1.2)  # (1100 queued + 100 uncached) / 1000 tokens/s
        assert (d.instance_id, d.reason) == ("b", "kv_cache")
        assert d.scores["b"] > d.scores["a"]
        # the same instance without the prefix loses to the idle one: the cache is what won it
        d = policy.route(RouteRequest(1000), [idle, snap("b", pending_prefill_tokens=1100)])
        assert (d.instance_id, d.reason) == ("a", "least_latency")


def test_kv_aware_score_formula():
    p = KVCacheAwarePolicy(alpha=1.0, gamma=1.0)
    d = p.route(RouteRequest(100), [snap("a", matched_tokens=50), snap("b", pending_prefill_tokens=100)])
    # latencies: a = 50/1000, b = (100 + 100)/1000 = max
    assert d.scores["a"] == pytest.approx(0.5 - 0.05 / 0.2)
    assert d.scores["b"] == pytest.approx(0.0 - 1.0)


def test_kv_aware_without_matches_goes_to_the_least_loaded():
    p = KVCacheAwarePolicy()
    d = p.route(RouteRequest(200), [snap("a", pending_prefill_tokens=400), snap("b", num_running=3)])
    assert (d.instance_id, d.reason) == ("b", "least_latency")


def test_online_requests_see_online_load_offline_requests_all_of_it():
    """Offline work (co-location) yields to online work, so an online request is routed as if it were
    not there; an offline request waits behind everything."""
    # a: a big offline backlog, little online work; b: more online work, nothing offline
    a = snap("a", num_running=12, num_waiting=30, inflight=42, pending_prefill_tokens=9000, offline_running=10,
             offline_waiting=30, offline_inflight=40, offline_pending_prefill_tokens=8800)
    b = snap("b", num_running=4, num_waiting=1, inflight=5, pending_prefill_tokens=600)
    seen = a.online_only()
    assert (seen.num_running, seen.num_waiting, seen.inflight, seen.pending_prefill_tokens) == (2, 0, 2, 200)
    assert seen.offline_running == seen.offline_pending_prefill_tokens == 0 and b.online_only() is b
    for policy in (KVCacheAwarePolicy(), LeastLoadPolicy()):
        assert policy.route(RouteRequest(200), [a, b]).instance_id == "a"
        assert policy.route(RouteRequest(200, offline=True), [a, b]).instance_id == "b"
    # a report older than the router's own accounting cannot go negative
    odd = snap("c", num_running=1, offline_running=3, pending_prefill_tokens=10, offline_pending_prefill_tokens=50)
    assert odd.online_only().num_running == 0 and odd.online_only().pending_prefill_tokens == 0


def test_a_hot_prefix_spills_over_when_its_instance_gets_much_slower():
    p = KVCacheAwarePolicy(fallback_ratio=2.0, fallback_slack=0.0)
    # a holds 900 of 1000 tokens but has 5000 prefill tokens queued: 5.1 s vs b's 1.0 s
    d = p.route(RouteRequest(1000), [snap("a", matched_tokens=900, pending_prefill_tokens=5000), snap("b")])
    assert (d.instance_id, d.reason) == ("b", "load_fallback")
    # moderately busier is still worth it for the cache
    d = p.route(RouteRequest(1000), [snap("a", matched_tokens=900, pending_prefill_tokens=1500), snap("b")])
    assert d.instance_id == "a"


def test_simulated_hot_prefix_is_shared_once_the_first_instance_is_loaded():
    """Many requests with one 900-token prefix: the prefix holder takes them until its queue makes
    it much slower, then the other instance takes some too (and would cache the prefix)."""
    p = KVCacheAwarePolicy()
    pending = {"a": 0, "b": 0}
    matched = {"a": 900, "b": 0}
    picks = []
    for _ in range(60):
        cands = [snap(w, matched_tokens=matched[w], pending_prefill_tokens=pending[w]) for w in ("a", "b")]
        d = p.route(RouteRequest(1000), cands)
        pending[d.instance_id] += 1000 - matched[d.instance_id]
        matched[d.instance_id] = 900  # it holds the prefix from now on
        picks.append(d.instance_id)
    counts = collections.Counter(picks)
    assert counts["a"] > counts["b"] > 0
    assert pending["a"] < 4 * pending["b"] + 2000


def test_overloaded_instances_are_avoided():
    p = KVCacheAwarePolicy(max_waiting=4, kv_high_watermark=0.9)
    d = p.route(RouteRequest(100), [snap("a", matched_tokens=100, num_waiting=4), snap("b", pending_prefill_tokens=50)])
    assert d.instance_id == "b"
    d = p.route(RouteRequest(100), [snap("a", matched_tokens=100, kv_usage=0.95), snap("b")])
    assert d.instance_id == "b"
    # all overloaded: still routes
    assert p.route(RouteRequest(100), [snap("a", num_waiting=9)]).instance_id == "a"


def test_session_affinity_is_a_strong_hint_with_expiry():
    clock = Clock()
    p = KVCacheAwarePolicy(session_ttl=60.0, clock=clock)
    first = p.route(RouteRequest(100, "chat-1"), [snap("a", pending_prefill_tokens=10), snap("b")])
    assert first.instance_id == "b"
    # b is now a bit busier, a holds a little prefix: the session still sticks to b
    d = p.route(RouteRequest(120, "chat-1"),
                [snap("a", matched_tokens=16), snap("b", pending_prefill_tokens=150)])
    assert (d.instance_id, d.reason) == ("b", "session")
    # ... but not when b became far slower (load-aware fallback)
    d = p.route(RouteRequest(120, "chat-1"), [snap("a"), snap("b", pending_prefill_tokens=10_000)])
    assert d.instance_id == "a"
    # the session moved to a; after the TTL it is forgotten
    clock.t += 61
    d = p.route(RouteRequest(120, "chat-1"), [snap("a", pending_prefill_tokens=500), snap("b")])
    assert (d.instance_id, d.reason) == ("b", "least_latency")


def test_session_of_a_departed_instance_is_dropped():
    p = KVCacheAwarePolicy()
    p.route(RouteRequest(10, "s"), [snap("a")])
    p.forget_instance("a")
    assert p.route(RouteRequest(10, "s"), [snap("a", pending_prefill_tokens=5), snap("b")]).reason != "session"


def test_sessions_are_bounded():
    p = KVCacheAwarePolicy(max_sessions=3)
    for i in range(10):
        p.route(RouteRequest(10, f"s{i}"), [snap("a")])
    assert list(p._sessions) == ["s7", "s8", "s9"]


def test_unknown_prefill_speed_uses_measured_peers_then_default():
    p = KVCacheAwarePolicy(default_prefill_rate=100.0)
    d = p.route(RouteRequest(100), [InstanceSnapshot("a"), InstanceSnapshot("b", prefill_tokens_per_s=1000.0)])
    assert d.predicted_latency == pytest.approx(0.1)
    d = p.route(RouteRequest(100), [InstanceSnapshot("a")])
    assert d.predicted_latency == pytest.approx(1.0)


def test_routing_imports_without_torch():
    code = "import sys, xllm.sched.routing, xllm.sched; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_new_prefix_goes_to_the_emptier_cache():
    p = KVCacheAwarePolicy()
    for _ in range(4):
        d = p.route(RouteRequest(100), [snap("a", cached_blocks=40), snap("b", cached_blocks=10)])
        assert d.instance_id == "b"


@pytest.mark.parametrize(("disk_speed", "choice"), [(500.0, "a"), (50_000.0, "b"), (None, "a")])
def test_kv_aware_weighs_a_deep_lower_tier_hit_against_a_shallow_memory_hit_by_predicted_ttft(disk_speed, choice):
    """Instance a holds 400 of 2,000 prompt tokens in memory; b holds none there but could load 1,600
    from disk. At 1,000 tokens/s of prefill: a disk loading 500 tokens/s is slower than recomputing
    (a wins, and b's hit is worth nothing in the score); one loading 50,000 tokens/s makes b's first
    token ~5x sooner (b wins); a disk whose speed b has not measured counts as recompute."""
    speeds = () if disk_speed is None else (("disk", disk_speed),)
    a = snap("a", matched_tokens=400)
    b = snap("b", lower_matched=(("disk", 1600),), tier_load_tokens_per_s=speeds)
    p = KVCacheAwarePolicy()
    d = p.route(RouteRequest(2000), [a, b])
    assert d.instance_id == choice
    loaded, load_s, _ = p.lower_tier_plan(b, 2000, 1000.0)
    # b computes the 400 tokens no tier has and loads the rest, or computes all 2,000
    expected_b = 2.0 if disk_speed is None else 400 / 1000 + 1600 / disk_speed
    assert p.predicted_latency(b, 2000, 1000.0) == pytest.approx(expected_b)
    assert (loaded, load_s) == ((0, 0.0) if disk_speed is None else (1600, 1600 / disk_speed))
    if disk_speed == 500.0:
        assert p.reuse(b, 2000, 1000.0) == 0.0  # slower than recomputing: no reuse credit
    # kv_aware_t0 (the benchmark's baseline) does not see b's disk: a's memory hit wins whatever the speed
    blind = ROUTING_POLICIES.create("kv_aware_t0")
    assert blind.route(RouteRequest(2000), [a, b]).instance_id == "a"
    assert blind.predicted_latency(b, 2000, 1000.0) == pytest.approx(2.0)


def test_kv_aware_lower_tier_hits_stop_at_the_first_unmeasured_tier_and_leave_the_last_token_computed():
    p = KVCacheAwarePolicy()
    c = snap("c", matched_tokens=100, lower_matched=(("host", 300), ("store", 200), ("disk", 400)),
             tier_load_tokens_per_s=(("host", 10_000.0), ("disk", 10_000.0)))
    assert p.lower_tier_plan(c, 1000, 1000.0)[0] == 300  # the store's speed is unknown: stop there
    full = snap("f", lower_matched=(("host", 1000),), tier_load_tokens_per_s=(("host", 10_000.0),))
    assert p.lower_tier_plan(full, 1000, 1000.0)[0] == 999


# ---- latency from the instances' step-time models ---------------------------------------------------
PROFILE = StepTimeModel((0.02, 5.6e-4, 3e-7, 2.1e-6, 1.6e-4))  # const, tokens, prefill attn, decode ctx, seqs


def test_kv_aware_predicts_from_the_step_model_not_the_measured_rate():
    """The defect the live sim-validate run showed: engine-1, warmed up on 32-token prompts, measured
    a slow prefill rate and, never sent work again to measure it anew, lost every request to engine-0,
    which had a request decoding. Same model: the idle instance is the faster one."""
    busy = snap("engine-0", num_running=1, decode_context_tokens=400, prefill_tokens_per_s=3000.0,
                step_model=PROFILE, token_budget=512)
    idle = snap("engine-1", prefill_tokens_per_s=400.0, step_model=PROFILE, token_budget=512)
    p = KVCacheAwarePolicy()
    d = p.route(RouteRequest(220), [busy, idle])
    assert d.instance_id == "engine-1"
    assert d.predicted_latency == pytest.approx(PROFILE.prefill_seconds(220, 0, 512))
    # the rates alone would have sent it to the busy one
    blind = [replace(busy, step_model=None), replace(idle, step_model=None)]
    assert p.route(RouteRequest(220), blind).instance_id == "engine-0"


def test_kv_aware_model_latency_counts_the_queue_the_chunks_and_the_decode_rows():
    p = KVCacheAwarePolicy()
    c = snap("a", num_running=4, decode_context_tokens=2000, pending_prefill_tokens=1000, matched_tokens=64,
             step_model=PROFILE, token_budget=256)
    expected = (PROFILE.queue_seconds(1000, 600, 256, 4, 2000)
                + PROFILE.prefill_seconds(600 - 64, 64, 256, 4, 2000))
    assert p.predicted_latency(c, 600, 1.0, PROFILE) == pytest.approx(expected)
    # more decode rows sharing the chunks, or a longer context, is a later first token
    assert p.predicted_latency(replace(c, num_running=16), 600, 1.0, PROFILE) > expected
    assert p.predicted_latency(replace(c, decode_context_tokens=20000), 600, 1.0, PROFILE) > expected


def test_kv_aware_instance_without_a_model_borrows_its_peers_mean():
    slow = StepTimeModel(tuple(2 * x for x in PROFILE.coefficients))
    a = snap("a", step_model=PROFILE, token_budget=512, num_running=2, decode_context_tokens=300)
    b = snap("b", step_model=slow, token_budget=512, num_running=2, decode_context_tokens=300)
    new = snap("c", prefill_tokens_per_s=0.0, token_budget=512, num_running=2, decode_context_tokens=300)
    d = KVCacheAwarePolicy().route(RouteRequest(300), [a, b, new])
    mean = mean_model([PROFILE, slow])
    assert d.instance_id == "a"
    assert d.scores["c"] < d.scores["a"] and d.scores["c"] > d.scores["b"]
    assert KVCacheAwarePolicy().predicted_latency(new, 300, 1.0, mean) == pytest.approx(
        mean.prefill_seconds(300, 0, 512, 2, 300))


def test_an_adapters_residency_is_weighed_against_load():
    """A LoRA adapter's request: an instance where the adapter is not resident pays its measured load time (so
    equal instances go to the resident one), but a resident instance that is busier by more than that loses;
    an instance whose slots all hold other adapters' live requests is avoided while another can take it."""
    p = KVCacheAwarePolicy()
    cold = {"adapter_resident": False, "adapter_load_seconds": 0.3}
    d = p.route(RouteRequest(200), [snap("a", **cold), snap("b")])
    assert d.instance_id == "b" and d.predicted_latency == pytest.approx(0.2)
    assert d.scores["a"] < d.scores["b"]
    # b resident but 600 queued prefill tokens (0.6 s) behind: loading the adapter on a (0.3 s) is faster
    d = p.route(RouteRequest(200), [snap("a", **cold), snap("b", pending_prefill_tokens=600)])
    assert d.instance_id == "a" and d.predicted_latency == pytest.approx(0.5)
    # a's slots are all taken by other adapters' live requests: b despite its load, a when it is the only one
    starved = {**cold, "adapter_slot_free": False}
    d = p.route(RouteRequest(200), [snap("a", **starved), snap("b", pending_prefill_tokens=600)])
    assert d.instance_id == "b"
    assert p.route(RouteRequest(200), [snap("a", **starved)]).instance_id == "a"
