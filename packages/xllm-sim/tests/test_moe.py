"""The simulator's expert-parallel model (:mod:`xllm.sim.moe`): the default placement's imbalance on a skewed
trace, EPLB's (the engine's policy code) after its first window, and the straggler-wait accounting."""

from __future__ import annotations

import pytest

from xllm.sim.moe import simulate_ep, synthetic_trace


def test_eplb_evens_a_skewed_trace_at_many_ranks():
    trace = synthetic_trace(windows=6, layers=2, experts=64, tokens=512, top_k=4, skew=1.0, drift=0.05)
    for ranks in (8, 16):
        off = simulate_ep(trace, ranks, redundant=ranks)
        on = simulate_ep(trace, ranks, redundant=ranks, eplb=True)
        assert off.mean_imbalance() > 1.5
        assert on.imbalance[0] == pytest.approx(off.imbalance[0])  # the first window runs the default placement
        assert max(on.imbalance[1:]) <= 1.2, on.imbalance
        assert on.wait(1) < off.wait(1) / 2


def test_straggler_wait_is_max_minus_mean():
    # one layer, 2 experts on 2 ranks: loads 30 and 10 -> wait 30 - 20 = 10 of 30 busy
    r = simulate_ep([[[30.0, 10.0]]], ranks=2)
    assert r.wait_tokens == [10.0] and r.busy_tokens == [30.0] and r.imbalance == [1.5]
    assert r.wait_fraction() == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        simulate_ep([], ranks=2)
