"""The policies other parts of xllm-sched provide, run by the simulator: co-location (offline
requests) and dynamic PD roles (flips, drains, moves)."""

from __future__ import annotations

import pytest

from xllm.sched.colocation import ColocationPolicy
from xllm.sched.elastic import SLORoleFlipPolicy
from xllm.sched.latency import StepTimeModel
from xllm.sim import Cluster, SimConfig, Workload, synthetic
from xllm.sim.events import PD_TICK

MODEL = StepTimeModel((0.004, 0.0004, 3.1e-7, 2e-7, 0.0005))


def run(cfg: SimConfig, workload: Workload, n: int, seed: int = 0) -> Cluster:
    cluster = Cluster(cfg, MODEL)
    cluster.run(synthetic(workload, n, seed))
    return cluster


def test_colocation_without_offline_requests_decides_as_decode_first():
    w = Workload(rate=12, prompt="uniform:50:600", output="uniform:5:80")
    base = dict(instances=2, heartbeat_s=0.0, kv_blocks=300, slo_tpot_s=0.05)
    a = run(SimConfig(**base), w, 300)
    b = run(SimConfig(batch_policy="colocation", **base), w, 300)
    assert isinstance(b.instances[0].policy, ColocationPolicy)
    assert b.instances[0].policy.clock() == b.q.now and b.instances[0].policy.slo_tpot_s == 0.05
    assert [r.to_dict() for r in a.requests] == [r.to_dict() for r in b.requests]


def test_colocation_protects_online_tpot():
    """Half the requests offline: decode_first treats them alike; colocation admits offline work only
    within the 40 ms TPOT objective (by the step model) and preempts it for online requests."""
    w = Workload(rate=6, prompt="uniform:50:400", output="uniform:50:200", offline_fraction=0.5)
    base = dict(instances=1, heartbeat_s=0.0, slo_tpot_s=0.04)
    plain = run(SimConfig(**base), w, 300).report()
    colo = run(SimConfig(batch_policy="colocation", **base), w, 300).report()
    assert plain["completed"] == colo["completed"] == 300
    assert colo["tpot_ms"]["p90"] < plain["tpot_ms"]["p90"]
    assert colo["offline"]["completed"] == plain["offline"]["completed"] > 0


def test_dynamic_pd_flips_under_a_prefill_burst_and_drains():
    """1 prefill + 3 decode instances and long prompts: TTFT pressure flips decode instances to
    prefill; their running requests move off; every request finishes and every block comes back."""
    w = Workload(arrivals="gamma", rate=4, cv=2, prompt="uniform:1500:2500", output="uniform:20:200")
    cfg = SimConfig(prefill_instances=1, decode_instances=3, pd_policy="dynamic", slo_ttft_s=2.0, slo_tpot_s=0.1,
                    heartbeat_s=0.25, pd_interval_s=0.5)
    cluster = run(cfg, w, 400)
    assert isinstance(cluster.roles.policy, SLORoleFlipPolicy)
    r = cluster.report()
    assert r["completed"] == 400
    assert r["role_flips"] >= 1 and r["role_flip_log"][0]["to"] == "prefill"
    assert sum(i.role == "prefill" for i in cluster.instances) >= 2
    assert all(i.kv.used == 0 and i.flipping is None for i in cluster.instances)
    static = run(SimConfig(prefill_instances=1, decode_instances=3, slo_ttft_s=2.0, slo_tpot_s=0.1,
                           heartbeat_s=0.25), w, 400).report()
    assert static["role_flips"] == 0
    assert r["ttft_ms"]["p50"] < static["ttft_ms"]["p50"]


def test_prefill_overflow_runs_prompts_whole_on_decode_instances_when_the_prefill_side_would_miss():
    """1 prefill + 3 decode instances, static roles, bursts of long prompts: with the TTFT objective
    and pd_overflow, the prompts the prefill instance would serve late run whole on decode instances
    (prefilled and decoded there, nothing transferred); the rest go through the pair. TTFT improves,
    every request finishes and every block comes back; without overflow none runs whole."""
    w = Workload(arrivals="gamma", rate=4, cv=2, prompt="uniform:1500:2500", output="uniform:20:200")
    base = dict(prefill_instances=1, decode_instances=3, slo_ttft_s=2.0, slo_tpot_s=0.1, heartbeat_s=0.25)
    pd = run(SimConfig(pd_overflow=False, **base), w, 400)
    over = run(SimConfig(**base), w, 400)
    local = [q for q in over.requests if q.instance == q.decode_instance]
    assert 0 < len(local) < 400 and all(q.transfer_bytes == 0 for q in local)
    assert all(q.instance.startswith("e") and q.instance != "e0" for q in local)  # e0 is the prefill instance
    assert not [q for q in pd.requests if q.instance == q.decode_instance]
    a, b = pd.report(), over.report()
    assert a["completed"] == b["completed"] == 400 and b["role_flips"] == 0
    assert b["ttft_ms"]["p90"] < a["ttft_ms"]["p90"] and b["slo_attainment"] > a["slo_attainment"]
    assert all(i.kv.used == 0 for i in over.instances)


def test_drain_moves_migrate_and_recompute():
    """A forced flip of a busy decode instance: its decoding requests leave it, by migration (KV bytes
    counted) or recompute, and all finish elsewhere."""
    w = Workload(rate=20, prompt="uniform:100:200", output="uniform:200:300")
    for mode in ("migrate", "recompute"):
        cfg = SimConfig(prefill_instances=1, decode_instances=2, heartbeat_s=0.0, drain_moves=mode)
        specs = list(synthetic(w, 60, 3))
        flipped = Cluster(cfg, MODEL)
        flipped.q.at(1.5, PD_TICK)  # while e1 and e2 decode; the static policy would never flip

        def force(_payload, c=flipped) -> None:
            c.roles.flip("e2", "prefill", "test")
        flipped._pd_tick = force  # the test's own decision in place of the policy's
        flipped.run(specs)
        r = flipped.report()
        assert r["completed"] == 60 and r["moves"] > 0
        assert all(req.decode_instance != "e2" or req.finish < 1.5 for req in flipped.requests)
        assert (r["kv_transfer_bytes"] > sum(req.spec.prompt_len * cfg.kv_bytes_per_token
                                             for req in flipped.requests)) == (mode == "migrate")
        assert all(i.kv.used == 0 for i in flipped.instances)
        assert [i.role for i in flipped.instances] == ["prefill", "decode", "prefill"]


def test_a_pd_prefill_reports_its_ttft_from_the_hand_over_not_the_decode_sides_wait():
    """One decode slot (max_num_seqs 1): the second request waits for the first's whole decode before
    its KV reservation, then its prompt goes to the prefill instance. The prefill engine measures TTFT
    from when it got the prompt (as a real engine does), so its recent TTFT stays one prefill's time
    (equal prompts: equal prefills) while the request's own TTFT includes the wait."""
    from xllm.sim import RequestSpec
    cfg = SimConfig(prefill_instances=1, decode_instances=1, max_num_seqs=1, heartbeat_s=0.0)
    cluster = Cluster(cfg, MODEL)
    cluster.run([RequestSpec(0, 0.0, 300, 50), RequestSpec(1, 0.0, 300, 50)])
    first, second = cluster.requests
    assert second.ttft > first.ttft + 49 * MODEL.decode_seconds(1, 300)  # waited for the first's decode
    assert cluster.instances[0].recent_ttft == pytest.approx(first.ttft)
