"""The simulator against hand-computed scenarios: every step, TTFT, E2E and figure worked out below
from the step model t = 0.01 + 0.001·tokens (pure Python, no torch)."""

from __future__ import annotations

import pytest

from xllm.sched.latency import StepTimeModel
from xllm.sim import Cluster, RequestSpec, SimConfig, Workload, synthetic

LINEAR = StepTimeModel((0.01, 0.001, 0.0, 0.0, 0.0))  # 10 ms + 1 ms per token of the step
EPS = 1e-9

# rid, arrival, prompt, output; round robin sends r0, r2, r4 to e0 and r1, r3 to e1
FIVE = [RequestSpec(0, 0.0, 100, 3), RequestSpec(1, 0.05, 50, 2), RequestSpec(2, 0.1, 200, 2),
        RequestSpec(3, 0.3, 30, 1), RequestSpec(4, 0.35, 64, 2)]


def small(**kw) -> SimConfig:
    base = dict(instances=2, routing="round_robin", heartbeat_s=0.0, block_size=16, kv_blocks=1000,
                prefix_cache=False)
    base.update(kw)
    return SimConfig(**base)


def simulate(cfg: SimConfig, specs, model: StepTimeModel = LINEAR) -> tuple[Cluster, list[tuple]]:
    cluster = Cluster(cfg, model)
    log = cluster.log_steps()
    cluster.run(specs)
    return cluster, log


def times(cluster: Cluster, attr: str) -> list[float]:
    return [getattr(r, attr) for r in sorted(cluster.requests, key=lambda r: r.spec.rid)]


def test_five_requests_step_by_step():
    cluster, log = simulate(small(), FIVE)
    # e0: r0 prefill (100 tok: 0.11 s); r2 arrives mid-step and joins the next one with r0's decode (201 tok);
    # both decode once more (2 tok) and finish; r4 arrives at 0.35 to an idle e0. e1: r1, then r3 (one token).
    expected = [
        (0.0, 0.11, "e0", ((0, 100),)),
        (0.05, 0.11, "e1", ((1, 50),)),
        (0.11, 0.321, "e0", ((0, 1), (2, 200))),
        (0.11, 0.121, "e1", ((1, 1),)),
        (0.3, 0.34, "e1", ((3, 30),)),
        (0.321, 0.333, "e0", ((0, 1), (2, 1))),
        (0.35, 0.424, "e0", ((4, 64),)),
        (0.424, 0.435, "e0", ((4, 1),)),
    ]
    assert [e[2:] for e in log] == [e[2:] for e in expected]
    for got, want in zip(log, expected):
        assert got[0] == pytest.approx(want[0], abs=EPS) and got[1] == pytest.approx(want[1], abs=EPS)
    assert times(cluster, "ttft") == pytest.approx([0.11, 0.06, 0.221, 0.04, 0.074], abs=EPS)
    assert times(cluster, "e2e") == pytest.approx([0.333, 0.071, 0.233, 0.04, 0.085], abs=EPS)
    assert [r.instance for r in sorted(cluster.requests, key=lambda r: r.spec.rid)] == ["e0", "e1", "e0", "e1", "e0"]


def test_five_requests_metrics():
    cluster, _ = simulate(small(slo_ttft_s=0.2, slo_tpot_s=0.05), FIVE)
    r = cluster.report()
    assert r["completed"] == 5 and r["duration_s"] == pytest.approx(0.435, abs=EPS)
    assert r["request_throughput"] == pytest.approx(5 / 0.435)
    assert r["output_throughput"] == pytest.approx(10 / 0.435)
    # TPOT: r0 (0.333-0.11)/2, r1 0.011, r2 0.012, r4 0.011 (r3 has one token: none)
    tpots = sorted([0.1115, 0.011, 0.012, 0.011])
    assert r["tpot_ms"]["n"] == 4
    assert r["tpot_ms"]["p50"] == pytest.approx((tpots[1] + tpots[2]) / 2 * 1e3)
    ttfts = sorted([0.11, 0.06, 0.221, 0.04, 0.074])
    assert r["ttft_ms"]["p50"] == pytest.approx(ttfts[2] * 1e3)
    assert r["ttft_ms"]["p90"] == pytest.approx((ttfts[3] + 0.6 * (ttfts[4] - ttfts[3])) * 1e3)
    # r0 misses TPOT (111.5 ms), r2 misses TTFT (221 ms): 3 of 5 meet the SLO
    assert r["slo_attainment"] == pytest.approx(0.6)
    assert r["goodput"] == pytest.approx(3 / 0.435)
    busy = {"e0": 0.11 + 0.211 + 0.012 + 0.074 + 0.011, "e1": 0.06 + 0.011 + 0.04}
    assert {i["instance_id"]: i["utilisation"] for i in r["instances"]} == pytest.approx(
        {k: v / 0.435 for k, v in busy.items()})


def test_the_batch_policy_decides_a_smaller_budget_splits_the_prompt():
    """DecodeFirstPolicy with a 150-token budget: r0's decode (1) + 149 of r2's prompt, then the
    other 51 with r0's last decode; r2's first token comes later, r0 finishes a little earlier."""
    cluster, log = simulate(small(max_num_batched_tokens=150), FIVE)
    e0 = [(round(s, 6), round(e, 6), chunks) for s, e, iid, chunks in log if iid == "e0"]
    assert e0[:4] == [(0.0, 0.11, ((0, 100),)), (0.11, 0.27, ((0, 1), (2, 149))),
                      (0.27, 0.332, ((0, 1), (2, 51))), (0.332, 0.343, ((2, 1),))]
    assert times(cluster, "ttft")[2] == pytest.approx(0.232, abs=EPS)
    assert times(cluster, "e2e")[0] == pytest.approx(0.332, abs=EPS)
    assert times(cluster, "e2e")[2] == pytest.approx(0.243, abs=EPS)


def test_prefix_hits_skip_cached_blocks():
    """Two requests of one prefix group on one instance: the second computes only what the first
    did not cache (4 full 16-token blocks of the 64-token prefix)."""
    specs = [RequestSpec(0, 0.0, 100, 1, prefix_group=7, prefix_len=64),
             RequestSpec(1, 1.0, 80, 1, prefix_group=7, prefix_len=64)]
    cluster, log = simulate(small(instances=1, prefix_cache=True), specs)
    assert [chunks for *_, chunks in log] == [((0, 100),), ((1, 16),)]
    assert times(cluster, "ttft") == pytest.approx([0.11, 0.026], abs=EPS)
    assert cluster.report()["prefix_hit_rate"] == pytest.approx(64 / 180)


def test_kv_aware_routing_follows_the_cached_prefix():
    specs = [RequestSpec(0, 0.0, 100, 1, prefix_group=1, prefix_len=96),
             RequestSpec(1, 0.0, 100, 1, prefix_group=2, prefix_len=96),
             *[RequestSpec(i, 1.0 + i, 120, 1, prefix_group=1 + i % 2, prefix_len=96) for i in range(2, 8)]]
    cluster, _ = simulate(small(routing="kv_aware", prefix_cache=True), specs)
    home = {r.spec.prefix_group: r.instance for r in cluster.requests[:2]}
    assert home[1] != home[2]
    assert all(r.instance == home[r.spec.prefix_group] for r in cluster.requests)
    assert all(r.matched_tokens == 96 for r in cluster.requests[2:])


def test_pd_handoff_with_transfer_cost():
    """1 prefill + 1 decode: token 1 on P at 0.11; 100 tokens × 1000 B at 1 MB/s = 0.1 s to D; D decodes
    tokens 2 and 3 (11 ms each)."""
    cfg = small(prefill_instances=1, decode_instances=1, kv_bytes_per_token=1000, kv_bandwidth=1e6)
    cluster, log = simulate(cfg, [RequestSpec(0, 0.0, 100, 3)])
    assert [(iid, chunks) for _, _, iid, chunks in log] == [("e0", ((0, 100),)), ("e1", ((0, 1),)),
                                                            ("e1", ((0, 1),))]
    (r,) = cluster.requests
    assert (r.instance, r.decode_instance) == ("e0", "e1")
    assert r.ttft == pytest.approx(0.11, abs=EPS) and r.e2e == pytest.approx(0.232, abs=EPS)
    assert r.transfer_bytes == 100_000
    assert all(i.kv.used == 0 and not i.handing_off and not i.awaiting for i in cluster.instances)


def test_deterministic_for_a_seed():
    w = Workload(arrivals="gamma", rate=20, cv=3, prompt="uniform:16:300", output="uniform:1:40",
                 prefix_groups=3, prefix_len=48)
    cfg = SimConfig(instances=3, heartbeat_s=0.2, kv_blocks=200, block_size=16)

    def run(seed: int) -> list:
        c = Cluster(cfg, LINEAR)
        c.run(synthetic(w, 300, seed))
        return [r.to_dict() for r in c.requests]

    first = run(1)
    assert first == run(1)
    assert first != run(2)


def test_kv_pressure_preempts_and_every_request_finishes():
    """A KV cache too small for the load: the batch policy preempts, recomputed requests still finish
    and every block is returned."""
    w = Workload(rate=50, prompt="uniform:100:200", output="uniform:20:60")
    cluster = Cluster(SimConfig(instances=2, kv_blocks=40, block_size=16, heartbeat_s=0.0), LINEAR)
    cluster.run(synthetic(w, 200, 0))
    r = cluster.report()
    assert r["completed"] == 200 and r["preemptions"] > 0
    assert all(i.kv.used == 0 and not i.running and not i.waiting for i in cluster.instances)


def test_scale_20_instances_2k_requests():
    w = Workload(arrivals="gamma", rate=60, cv=2, prefix_groups=10, prefix_len=128)
    cluster = Cluster(SimConfig(instances=20), StepTimeModel((0.004, 0.0004, 3.1e-7, 2e-7, 0.0005)))
    cluster.run(synthetic(w, 2000, 0))
    r = cluster.report()
    assert r["completed"] == 2000
    assert 0 < r["utilisation"]["mean"] <= 1 and r["prefix_hit_rate"] > 0
    assert all(i.kv.used == 0 for i in cluster.instances)


def test_step_noise_scatters_step_times_around_the_model_and_the_policies_predict_the_model():
    """With step_noise each step takes the model's time times a lognormal factor of mean 1: the log of
    the measured-over-model ratios has the given deviation and a mean near -sigma²/2, the run is
    deterministic, and the batch policy (co-location's predictor) still sees the model itself."""
    import math
    import statistics

    w = Workload(rate=8, prompt="uniform:16:300", output="uniform:1:40")
    cfg = small(step_noise=0.2, batch_policy="colocation", slo_tpot_s=0.5)
    cluster, log = simulate(cfg, list(synthetic(w, 300, 0)))
    by_rid = {r.spec.rid: r for r in cluster.requests}
    ratios = []
    for start, end, _, chunks in log:
        tokens = sum(n for _, n in chunks)
        ratios.append(math.log((end - start) / LINEAR.step_seconds(_shape_of(tokens, len(chunks)))))
    assert statistics.stdev(ratios) == pytest.approx(0.2, rel=0.15)
    assert statistics.fmean(ratios) == pytest.approx(-0.02, abs=0.03)
    again, _ = simulate(cfg, list(synthetic(w, 300, 0)))
    assert [r.to_dict() for r in again.requests] == [r.to_dict() for r in by_rid.values()]
    assert cluster.instances[0].policy.predict(_shape_of(10, 1)) == LINEAR.step_seconds(_shape_of(10, 1))
    with pytest.raises(ValueError, match="step_noise"):
        SimConfig(step_noise=-0.1).check()


def _shape_of(tokens: int, chunks: int):
    """A shape with ``tokens`` tokens in ``chunks`` chunks (LINEAR reads only the token count)."""
    from xllm.sched.latency import StepShape

    return StepShape((), ((0, 1),) * (chunks - 1) + ((0, tokens - chunks + 1),))
