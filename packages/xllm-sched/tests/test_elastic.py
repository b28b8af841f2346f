"""Dynamic PD roles as pure logic: which instance flips, when, and when it must not.

The oracle is the rule set of :mod:`xllm.sched.elastic` written out per case: flips in both
directions with their triggers, the hysteresis window, the N/(N-1) spare check, cool-downs (per
instance and cluster-wide), the minimum per role, instances already flipping, deterministic ties,
predicted TTFT, and a constant-demand cluster model in which no load pattern makes a role go back
and forth."""

from __future__ import annotations

import itertools

import pytest

from xllm.sched import PD_POLICIES, RoleFlip, RoleLoad, SLORoleFlipPolicy, StaticRoles
from xllm.sched.elastic import WindowMean, auto_flips
from xllm.sched.latency import StepTimeModel

TTFT, TPOT = 1.0, 0.05  # SLOs (seconds)


def load(iid: str, role: str, *, ttft: float = 0.0, tpot: float = 0.0, running: int = 0, waiting: int = 0,
         pending: int = 0, flipping: bool = False, **kw) -> RoleLoad:
    return RoleLoad(iid, role, running, waiting, pending, ttft, tpot, flipping, **kw)


def policy(**kw) -> SLORoleFlipPolicy:
    kw.setdefault("window_s", 2.0)
    kw.setdefault("cooldown_s", 10.0)
    kw.setdefault("cluster_cooldown_s", 3.0)
    return SLORoleFlipPolicy(TTFT, TPOT, **kw)


def cluster(ttft: float, tpot: float, roles: dict[str, str], busy: dict[str, int] | None = None,
            flipping: frozenset[str] = frozenset()) -> list[RoleLoad]:
    """Every prefill instance at ``ttft`` s, every decode one at ``tpot`` s; ``busy``: running requests."""
    busy = busy or {}
    return [load(iid, role, ttft=ttft if role == "prefill" else 0.0, tpot=tpot if role == "decode" else 0.0,
                 running=busy.get(iid, 1), flipping=iid in flipping) for iid, role in roles.items()]


ONE_P_TWO_D = {"p0": "prefill", "d0": "decode", "d1": "decode"}
TWO_P_ONE_D = {"p0": "prefill", "p1": "prefill", "d0": "decode"}


def test_ttft_pressure_held_for_the_window_flips_the_least_loaded_decode_instance():
    pol = policy()
    loads = cluster(2.0, 0.01, ONE_P_TWO_D, busy={"d0": 5, "d1": 2})
    assert pol.decide(0.0, loads) == []          # pressure on, not held yet
    assert pol.decide(1.9, loads) == []
    (flip,) = pol.decide(2.0, loads)
    assert (flip.instance_id, flip.from_role, flip.to_role, flip.trigger) == ("d1", "decode", "prefill",
                                                                              "ttft_pressure")
    assert "TTFT pressure" in flip.reason and "d1" in flip.reason and "2.00x" in flip.reason


def test_tpot_pressure_flips_the_least_loaded_prefill_instance():
    pol = policy()
    loads = [load("p0", "prefill", ttft=0.3, pending=900, running=1), load("p1", "prefill", ttft=0.3, pending=100),
             load("d0", "decode", tpot=0.08, running=12)]
    assert pol.decide(0.0, loads) == []
    (flip,) = pol.decide(5.0, loads)
    assert (flip.instance_id, flip.to_role, flip.trigger) == ("p1", "decode", "tpot_pressure")
    assert "TPOT pressure" in flip.reason and "1.60x" in flip.reason


def test_no_flip_when_the_donor_side_could_not_spare_an_instance():
    """TTFT at 1.5x, two decode instances at 0.5x: one fewer puts them at 1.0x >= high (0.9): no
    flip, the flip would only move the problem. At 0.4x (0.8x after) the flip goes ahead."""
    pol = policy()
    assert pol.decide(0.0, cluster(1.5, 0.025, ONE_P_TWO_D)) == []
    assert pol.decide(10.0, cluster(1.5, 0.025, ONE_P_TWO_D)) == []
    (flip,) = pol.decide(20.0, cluster(1.5, 0.020, ONE_P_TWO_D))
    assert flip.to_role == "prefill"


def test_hysteresis_pressure_between_the_thresholds_neither_starts_nor_resets_the_window():
    pol = policy(window_s=5.0)
    roles = ONE_P_TWO_D
    assert pol.decide(0.0, cluster(0.8, 0.01, roles)) == []   # below high: not on
    assert pol.decide(1.0, cluster(0.95, 0.01, roles)) == []  # on since t=1
    assert pol.decide(3.0, cluster(0.7, 0.01, roles)) == []   # between low and high: still on
    (flip,) = pol.decide(6.0, cluster(0.95, 0.01, roles))     # held 5 s
    assert flip.trigger == "ttft_pressure"
    pol = policy(window_s=5.0)
    assert pol.decide(1.0, cluster(0.95, 0.01, roles)) == []
    assert pol.decide(3.0, cluster(0.5, 0.01, roles)) == []   # below low: off
    assert pol.decide(6.0, cluster(0.95, 0.01, roles)) == []  # on again since t=6 only
    assert pol.decide(11.0, cluster(0.95, 0.01, roles))


def test_oscillating_load_around_the_threshold_does_not_flap():
    """TTFT swinging between 0.85x and 0.95x of the SLO (around ``high``) for ten minutes, ticks of
    0.5 s: one decode instance goes to prefill once (the pressure is real), nothing ever goes back."""
    pol = policy(window_s=5.0, cooldown_s=30.0, cluster_cooldown_s=10.0)
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"}
    flips: list[RoleFlip] = []
    for tick in range(1200):
        now = tick * 0.5
        flips += pol.decide(now, cluster(0.85 if tick % 2 else 0.95, 0.01, roles))
        for f in flips[-1:]:
            roles[f.instance_id] = f.to_role  # the flip completes at once
    assert [(f.from_role, f.to_role) for f in flips] == [("decode", "prefill")] * len(flips)
    assert 1 <= len(flips) <= 2  # at most until the decode side could not spare another


@pytest.mark.parametrize("prefill_demand, decode_demand",
                         list(itertools.product((0.3, 0.8, 1.0, 1.7, 2.6, 4.0), (0.2, 0.9, 1.3, 2.2, 3.5))))
def test_constant_demand_never_makes_an_instance_go_back_and_forth(prefill_demand, decode_demand):
    """A cluster model: each side's latency is its demand shared by its instances (x SLO), constant
    over time; flips complete within a tick. Whatever the demand, the roles settle: no instance
    flips one way and later back, and the flips stop."""
    pol = policy(window_s=1.0, cooldown_s=5.0, cluster_cooldown_s=2.0)
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode", "d2": "decode", "d3": "decode"}
    history: list[RoleFlip] = []
    for tick in range(600):
        n_p = sum(r == "prefill" for r in roles.values())
        n_d = len(roles) - n_p
        loads = cluster(prefill_demand / n_p * TTFT, decode_demand / n_d * TPOT, roles)
        for f in pol.decide(tick * 0.5, loads):
            roles[f.instance_id] = f.to_role
            history.append(f)
    directions = {(f.from_role, f.to_role) for f in history}
    assert len(directions) <= 1, history
    assert all(tick_flip.instance_id not in {f.instance_id for f in history[:i]}
               for i, tick_flip in enumerate(history))


def test_idle_prefill_capacity_goes_back_to_decode_preferring_the_instance_flipped_last():
    roles = {"a0": "prefill", "d0": "decode", "d1": "decode"}  # a0 sorts first: recency, not the id, decides
    idle = [load("d0", "prefill"), load("a0", "prefill"), load("d1", "decode", tpot=0.01, running=3)]
    for cooldown, back_to_decode in ((1.0, "d0"), (5.0, "a0")):
        pol = policy(window_s=1.0, cooldown_s=cooldown, cluster_cooldown_s=0.0)
        assert pol.decide(0.0, cluster(3.0, 0.01, roles)) == []
        (first,) = pol.decide(1.0, cluster(3.0, 0.01, roles))
        assert (first.instance_id, first.to_role) == ("d0", "prefill")  # equal load: the smaller id
        assert pol.decide(2.0, idle) == []          # headroom back, a0 and d0 idle: not held yet
        (back,) = pol.decide(3.0, idle)
        # both idle: the one flipped last goes back, unless it is still in its cool-down
        assert (back.instance_id, back.to_role, back.trigger) == (back_to_decode, "decode", "prefill_idle")
        assert "idle prefill capacity" in back.reason


def test_a_busy_prefill_side_is_not_idle_and_a_decode_side_is_never_flipped_for_idleness():
    pol = policy(window_s=0.0, cooldown_s=0.0, cluster_cooldown_s=0.0)
    busy = [load("p0", "prefill", pending=10), load("p1", "prefill", running=1), load("d0", "decode")]
    assert all(pol.decide(t, busy) == [] for t in range(10))
    idle_decodes = [load("p0", "prefill", ttft=0.1, running=1), load("d0", "decode"), load("d1", "decode"),
                    load("d2", "decode")]
    assert all(pol.decide(t, idle_decodes) == [] for t in range(10))


def test_cooldowns_per_instance_and_cluster_wide():
    pol = policy(window_s=0.0, cooldown_s=10.0, cluster_cooldown_s=3.0)
    roles = {"p0": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"}
    (f1,) = pol.decide(0.0, cluster(3.0, 0.005, roles))
    assert f1.instance_id == "d0"
    roles["d0"] = "prefill"
    assert pol.decide(1.0, cluster(3.0, 0.005, roles)) == []   # cluster cool-down
    (f2,) = pol.decide(3.0, cluster(3.0, 0.005, roles))
    assert f2.instance_id == "d1"
    roles["d1"] = "prefill"
    # now TPOT pressure: d0 and d1 are the least loaded prefill instances but still in their cool-down
    tpot = [load(i, r, tpot=0.2 if r == "decode" else 0.0, ttft=0.05 if r == "prefill" else 0.0,
                 running=0 if i in ("d0", "d1") else 4) for i, r in roles.items()]
    (f3,) = pol.decide(6.0, tpot)
    assert f3.instance_id == "p0"                               # the only one out of its cool-down
    roles["p0"] = "decode"
    tpot = [load(i, r, tpot=0.2 if r == "decode" else 0.0, ttft=0.05 if r == "prefill" else 0.0)
            for i, r in roles.items()]
    assert pol.decide(9.5, tpot) == []                          # d0, d1 still cooling down
    (f4,) = pol.decide(10.0, tpot)
    assert f4.instance_id == "d0"                               # out of its cool-down (d1 is until 13.0)


def test_min_per_role_holds_whatever_the_pressure():
    pol = policy(window_s=0.0, cooldown_s=0.0, cluster_cooldown_s=0.0)
    one_each = {"p0": "prefill", "d0": "decode"}
    for t in range(5):
        assert pol.decide(float(t), cluster(10.0, 0.001, one_each)) == []
        assert pol.decide(float(t) + 0.5, cluster(0.001, 10.0, one_each)) == []
    roles = dict(ONE_P_TWO_D)
    flips = []
    for t in range(10):
        for f in pol.decide(float(t), cluster(10.0, 0.001, roles)):
            roles[f.instance_id] = f.to_role
            flips.append(f)
    assert len(flips) == 1 and sum(r == "decode" for r in roles.values()) == 1
    pol = policy(window_s=0.0, cooldown_s=0.0, cluster_cooldown_s=0.0, min_per_role=2)
    assert all(pol.decide(float(t), cluster(10.0, 0.001, ONE_P_TWO_D)) == [] for t in range(5))


def test_an_instance_already_flipping_is_never_chosen_and_flips_in_progress_block_new_ones():
    pol = policy(window_s=0.0, cooldown_s=0.0, cluster_cooldown_s=0.0)
    roles = {"p0": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"}
    loads = cluster(5.0, 0.001, roles, busy={"d0": 0, "d1": 3, "d2": 4}, flipping=frozenset({"d0"}))
    assert pol.decide(0.0, loads) == []  # one flip under way (max_in_progress=1)
    pol = policy(window_s=0.0, cooldown_s=0.0, cluster_cooldown_s=0.0, max_in_progress=2)
    (flip,) = pol.decide(0.0, loads)
    assert flip.instance_id == "d1"      # d0 is the least loaded but already flipping
    # flipping instances count for neither side: with d0 and d1 flipping, d2 is the last decode one
    pol = policy(window_s=0.0, cooldown_s=0.0, cluster_cooldown_s=0.0, max_in_progress=3)
    assert pol.decide(1.0, cluster(5.0, 0.001, roles, flipping=frozenset({"d0", "d1"}))) == []


def test_auto_flip_limits_are_a_tenth_of_the_pd_instances():
    """``None`` limits (the gateway's default): one flip per decision below 20 instances, a tenth of
    them above; the same decision as explicit limits of that size."""
    assert [auto_flips(n) for n in (1, 2, 19, 20, 200, 205)] == [1, 1, 1, 2, 20, 20]
    small = {f"p{i}": "prefill" for i in range(2)} | {f"d{i}": "decode" for i in range(9)}
    big = {f"p{i}": "prefill" for i in range(40)} | {f"d{i}": "decode" for i in range(160)}
    for roles, k in ((small, 1), (big, 20)):
        loads = cluster(30.0, 0.001, roles)  # TTFT far over: the decode side can spare many
        auto = policy(window_s=0.0, max_in_progress=None, max_flips_per_decision=None).decide(0.0, loads)
        fixed = policy(window_s=0.0, max_in_progress=k, max_flips_per_decision=k).decide(0.0, loads)
        assert len(auto) == k and auto == fixed
    loads = cluster(30.0, 0.001, big, flipping=frozenset(f"d{i}" for i in range(15)))
    assert len(policy(window_s=0.0, max_in_progress=None, max_flips_per_decision=None).decide(0.0, loads)) == 5
    with pytest.raises(ValueError, match="max_in_progress"):
        policy(max_in_progress=0)


def test_ties_are_broken_by_instance_id_whatever_the_input_order():
    roles = {"d3": "decode", "d1": "decode", "p0": "prefill", "d2": "decode"}
    picks = set()
    for order in itertools.permutations(roles.items()):
        pol = policy(window_s=0.0)
        (flip,) = pol.decide(0.0, cluster(3.0, 0.001, dict(order)))
        picks.add(flip.instance_id)
    assert picks == {"d1"}


def test_predicted_ttft_from_the_queue_counts_before_any_request_was_measured():
    # a step model: 1 ms per token, so 1500 queued tokens wait 1.5 s (1.5x the SLO)
    model = StepTimeModel((0.0, 0.001, 0.0, 0.0, 0.0))
    loads = [load("p0", "prefill", pending=1500), load("d0", "decode"), load("d1", "decode")]
    assert policy(window_s=0.0).decide(0.0, loads) == []           # no model, no speed: nothing known
    (flip,) = policy(window_s=0.0, predictor=model).decide(0.0, loads)
    assert flip.to_role == "prefill"
    speed = [load("p0", "prefill", pending=1500, prefill_tokens_per_s=1000.0), load("d0", "decode"),
             load("d1", "decode")]
    (flip,) = policy(window_s=0.0).decide(0.0, speed)              # queue over the measured speed
    assert flip.to_role == "prefill"
    pol = policy(window_s=0.0, predictor=model)
    assert pol.tpot_estimate(load("d0", "decode", running=10, decode_context_tokens=1000)) == pytest.approx(0.01)


def test_predicted_ttft_is_a_new_requests_queue_wait_plus_its_own_prefill():
    """With the recent prompt size known, the estimate is a new request's: the queue taken as prompts
    of that size (each one's attention its own, not one long prompt's) plus its own prefill."""
    model = StepTimeModel((0.0, 0.001, 1e-6, 0.0, 0.0))  # 1 ms per token, 1 µs per attention pair
    pol = policy(predictor=model)
    one = model.prefill_seconds(1000)                      # 1.0 + 0.5 s
    assert one == pytest.approx(1.5)
    queued = load("p0", "prefill", pending=3000, recent_prompt_tokens=1000)
    assert pol.ttft_estimate(queued) == pytest.approx(4 * one)  # three queued prompts and its own
    idle = load("p0", "prefill", recent_prompt_tokens=1000)
    assert pol.ttft_estimate(idle) == pytest.approx(one)          # no queue: its own prefill
    assert pol.ttft_estimate(load("p0", "prefill", ttft=9.0, recent_prompt_tokens=1000)) == 9.0  # measured above
    # unknown prompt size: the queue read as one prompt, as before (attention 3000²/2 µs)
    assert pol.ttft_estimate(load("p0", "prefill", pending=3000)) == pytest.approx(3.0 + 4.5)
    assert model.queue_seconds(3000, 1000) == pytest.approx(3 * one)
    assert model.queue_seconds(2500, 1000) == pytest.approx(2 * one + model.prefill_seconds(500))
    assert model.queue_seconds(0, 1000) == 0.0
    assert model.ttft(1000, queued_prefill_tokens=3000, queued_prompt_tokens=1000) == pytest.approx(4 * one)
    # without a model: the queue and the prompt over the measured speed
    speed = load("p0", "prefill", pending=1000, recent_prompt_tokens=500, prefill_tokens_per_s=1000.0)
    assert policy().ttft_estimate(speed) == pytest.approx(1.5)


def test_an_instance_reported_step_model_overrides_the_cluster_predictor():
    # the profile says 1 ms per token (1500 queued tokens: 1.5 s, over the SLO); the instance itself
    # reports a corrected model 4x faster (0.375 s: within it) -> its own model decides, no flip
    profile = StepTimeModel((0.0, 0.001, 0.0, 0.0, 0.0))
    faster = StepTimeModel((0.0, 0.00025, 0.0, 0.0, 0.0))
    loads = [load("p0", "prefill", pending=1500, step_model=faster), load("d0", "decode"), load("d1", "decode")]
    pol = policy(window_s=0.0, predictor=profile)
    assert pol.ttft_estimate(loads[0]) == pytest.approx(0.375)
    assert pol.decide(0.0, loads) == []
    slower = [load("p0", "prefill", pending=1500), load("d0", "decode"), load("d1", "decode")]
    (flip,) = policy(window_s=0.0, predictor=faster).decide(0.0, [
        load("p0", "prefill", pending=1500, step_model=profile), *slower[1:]])
    assert flip.to_role == "prefill"  # the instance's own (slower) model shows the pressure


def test_static_never_flips_and_the_registry_builds_both():
    assert isinstance(PD_POLICIES.create("static", TTFT, TPOT, window_s=0.0), StaticRoles)
    static = PD_POLICIES.create("static")
    assert all(static.decide(float(t), cluster(50.0, 50.0, ONE_P_TWO_D)) == [] for t in range(5))
    dynamic = PD_POLICIES.create("dynamic", TTFT, TPOT, window_s=0.0)
    assert isinstance(dynamic, SLORoleFlipPolicy) and dynamic.decide(0.0, cluster(5.0, 0.0, ONE_P_TWO_D))
    assert PD_POLICIES.choices() == ["static", "dynamic"]


def test_mixed_instances_are_ignored_and_a_cluster_without_both_roles_flips_nothing():
    pol = policy(window_s=0.0, cooldown_s=0.0, cluster_cooldown_s=0.0)
    assert pol.decide(0.0, [load("m0", "mixed", ttft=9.0), load("d0", "decode"), load("d1", "decode")]) == []
    assert pol.decide(1.0, [load("p0", "prefill", ttft=9.0), load("p1", "prefill", ttft=9.0)]) == []


@pytest.mark.parametrize("kw", [dict(high=0.5, low=0.6), dict(low=0.0), dict(min_per_role=0),
                                dict(window_s=-1.0), dict(max_in_progress=0)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        policy(**kw)
    with pytest.raises(ValueError, match="slo_tpot_s"):
        SLORoleFlipPolicy(TTFT, 0.0)


def test_a_batch_decision_flips_what_the_pressure_needs_within_what_the_other_side_spares():
    """4 prefill instances at 1.8x TTFT (need 4·(1.8/0.9 − 1) = 4 more), 10 decode ones at 0.45x TPOT:
    without batches one flip; with up to 6 per decision the 4 least loaded decode instances, all at
    once; with the decode side at 0.6x only 3 can go (0.6·10/7 = 0.86 < 0.9; 4 fewer: 1.0); a batch
    never exceeds max_in_progress, and the next decision needs a fresh window and the cool-down."""
    roles = {**{f"p{i}": "prefill" for i in range(4)}, **{f"d{i}": "decode" for i in range(10)}}
    busy = {f"d{i}": 10 - i for i in range(10)}
    assert len(policy(window_s=0.0).decide(0.0, cluster(1.8, 0.0225, roles, busy))) == 1
    pol = policy(window_s=0.0, max_in_progress=8, max_flips_per_decision=6)
    flips = pol.decide(0.0, cluster(1.8, 0.0225, roles, busy))
    assert sorted(f.instance_id for f in flips) == ["d6", "d7", "d8", "d9"]
    assert all(f.trigger == "ttft_pressure" and "4 fewer" in f.reason for f in flips)
    assert pol.decide(1.0, cluster(1.8, 0.0225, roles, busy)) == []  # cluster cool-down (3 s)
    pol = policy(window_s=0.0, max_in_progress=8, max_flips_per_decision=6)
    assert sorted(f.instance_id for f in pol.decide(0.0, cluster(1.8, 0.03, roles, busy))) == ["d7", "d8", "d9"]
    pol = policy(window_s=0.0, max_in_progress=2, max_flips_per_decision=6)
    assert len(pol.decide(0.0, cluster(1.8, 0.0225, roles, busy))) == 2
    with pytest.raises(ValueError, match="max_flips_per_decision"):
        policy(max_flips_per_decision=0)


def test_batches_flip_for_pressure_but_idle_capacity_one_instance_at_a_time():
    """6 prefill instances, 4 idle, at 0.1x TTFT: with batches of 10, idle capacity still flips one
    instance per decision (not urgent); TPOT pressure (decode side at 2x, need 3·(2/0.9 − 1) = 4)
    flips the 4 least loaded prefill instances at once."""
    loads = [load(f"p{i}", "prefill", ttft=0.1, running=0 if i < 4 else 1, pending=0 if i < 4 else 100 * i)
             for i in range(6)]
    pol = policy(window_s=1.0, max_in_progress=10, max_flips_per_decision=10)
    calm = loads + [load(f"d{i}", "decode", tpot=0.01, running=3) for i in range(3)]
    assert pol.decide(0.0, calm) == []
    (flip,) = pol.decide(1.0, calm)
    assert (flip.instance_id, flip.trigger, flip.to_role) == ("p0", "prefill_idle", "decode")
    pol = policy(window_s=1.0, max_in_progress=10, max_flips_per_decision=10)
    pressed = loads + [load(f"d{i}", "decode", tpot=0.1, running=3) for i in range(3)]
    assert pol.decide(0.0, pressed) == []
    flips = pol.decide(1.0, pressed)
    assert sorted(f.instance_id for f in flips) == ["p0", "p1", "p2", "p3"]
    assert {f.trigger for f in flips} == {"tpot_pressure"}


def test_waiting_requests_on_a_decode_instance_count_as_tpot_pressure():
    """A decode instance running 4 requests within the TPOT SLO but with 60 more waiting for room
    is short of decode capacity: the TPOT predicted for all 64 at the same mean context."""
    model = StepTimeModel((0.01, 0.0, 0.0, 1e-5, 0.0005))  # const, tokens, attention, per context token, per seq
    pol = SLORoleFlipPolicy(TTFT, TPOT, predictor=model)
    running = load("d0", "decode", running=4, decode_context_tokens=2000)
    assert pol.tpot_estimate(running) == pytest.approx(model.decode_seconds(4, 2000))
    assert pol.tpot_estimate(running) < TPOT
    full = load("d0", "decode", running=4, waiting=60, decode_context_tokens=2000)
    assert pol.tpot_estimate(full) == pytest.approx(model.decode_seconds(64, 32000)) and pol.tpot_estimate(full) > TPOT


def test_a_latency_window_nobody_reads_stays_bounded():
    """The gateway measures every streamed chunk, also where no role controller reads the window (no PD
    instances): samples past the horizon are dropped as new ones come, and the mean is unchanged."""
    window = WindowMean(horizon=10.0)
    for i in range(10_000):
        window.add(i * 0.5, 1.0 if i < 9_990 else 3.0)
    assert len(window) == 21  # t = 4990 .. 4999.5
    assert window.mean(4999.5) == (11 * 1.0 + 10 * 3.0) / 21
