"""The EPD profiler's model (:mod:`xllm.sched.epd`): predictions worked out by hand for each strategy, the
layouts of a number of instances, and the ranking (layouts meeting the SLOs first, by headroom)."""

from __future__ import annotations

import math

import pytest

from xllm.sched import EPD_STRATEGIES
from xllm.sched.epd import E_P_D, ED_P, EP_D, EPDProfile, Layout, WorkloadMix, choose, layouts, predict
from xllm.sched.latency import StepTimeModel

PROFILE = EPDProfile(encode_s=0.2, prefill_s_per_token=0.001, decode_base_s=0.01, decode_per_seq_s=0.001,
                     max_batch=32, handoff_s=0.01)
MIX = WorkloadMix(rate=2.0, image_fraction=0.5, images_per_request=1, prompt_tokens=100, output_tokens=10)


def test_predictions_by_hand():
    # per request: encode 0.2 s (an image request), 0.1 s on average; prefill 0.1 s; decode: 20 tokens/s/instance
    ep = predict(Layout(EP_D, 0, 1, 1), PROFILE, MIX, 1.0, 1.0)
    assert ep.rho["prefill"] == pytest.approx(0.4)             # 2 x (0.1 + 0.1)
    assert ep.ttft_s == pytest.approx(0.3 / 0.6)                # (encode + prefill) / (1 - 0.4)
    batch = 20 * 0.01 / (1 - 20 * 0.001)                        # Little's law: B = lam base / (1 - lam k)
    assert ep.rho["decode"] == pytest.approx(0.02) and ep.tpot_s == pytest.approx(0.01 + 0.001 * batch)
    e = predict(Layout(E_P_D, 1, 1, 1), PROFILE, MIX, 1.0, 1.0)
    assert e.rho["encode"] == pytest.approx(0.2) and e.rho["prefill"] == pytest.approx(0.2)
    assert e.ttft_s == pytest.approx(0.2 / 0.8 + 0.01 + 0.1 / 0.8) and e.tpot_s == pytest.approx(ep.tpot_s)
    d = predict(Layout(ED_P, 0, 1, 1), PROFILE, MIX, 1.0, 1.0)
    share = 2 * 0.1                                             # of the decode instance's time, encoding
    room = 1 - share - 20 * 0.001
    batch = 20 * 0.01 / room
    mean = (0.01 + 0.001 * batch) / (1 - share)
    hits = share / 0.2 * 10 * mean                              # encodes its decode life meets, on average
    assert d.rho["decode"] == pytest.approx(1 - room)
    assert d.ttft_s == pytest.approx(0.2 / (1 - share) + 0.01 + 0.1 / 0.8)
    assert d.tpot_s == pytest.approx(mean + 1.28 * math.sqrt(hits) * 0.2 / 10)
    assert d.tpot_s > ep.tpot_s  # encoding on the decode instances costs TPOT
    assert all(p.meets for p in (ep, e, d))
    assert not predict(Layout(EP_D, 0, 1, 1), PROFILE, MIX, 0.45, 1.0).meets  # its TTFT is 0.5 s
    assert not predict(Layout(ED_P, 0, 1, 1), PROFILE, MIX, 1.0, 0.015).meets  # its TPOT is ~22 ms


def test_saturation_is_infinite_latency_and_no_layout_meets():
    flood = WorkloadMix(rate=20.0, image_fraction=1.0, images_per_request=2, prompt_tokens=100, output_tokens=10)
    p = predict(Layout(EP_D, 0, 1, 1), PROFILE, flood, 10.0, 10.0)
    assert p.rho["prefill"] > 1 and math.isinf(p.ttft_s) and not p.meets
    assert not any(x.meets for x in choose(PROFILE, flood, 3, 10.0, 10.0))


def test_layouts_of_four_instances():
    got = {str(lay) for lay in layouts(4)}
    assert got == {"ep+d (1P 3D)", "ep+d (2P 2D)", "ep+d (3P 1D)", "ed+p (1P 3D)", "ed+p (2P 2D)", "ed+p (3P 1D)",
                   "e+p+d (1E 1P 2D)", "e+p+d (1E 2P 1D)", "e+p+d (2E 1P 1D)"}


def test_ranking_meets_first_then_headroom():
    ranked = choose(PROFILE, MIX, 3, 0.45, 1.0)
    assert [p.meets for p in ranked] == sorted((p.meets for p in ranked), reverse=True)
    assert str(ranked[-1].layout) == "ep+d (1P 2D)" and not ranked[-1].meets  # one prefill instance: TTFT 0.5 s
    meeting = [p for p in ranked if p.meets]
    assert [p.headroom for p in meeting] == sorted((p.headroom for p in meeting), reverse=True)
    # encode-heavy: with images three times as costly, the layouts that take encoding off the lone prefill instance
    heavy = EPDProfile(0.6, 0.001, 0.01, 0.001, 32, 0.01)
    assert choose(heavy, MIX, 3, 3.0, 1.0)[0].layout.strategy is not EP_D


def test_the_profile_from_a_step_model():
    model = StepTimeModel((0.004, 0.0004, 0.0, 2.0e-7, 0.0005))
    p = EPDProfile.from_step_model(model, 0.3, prompt_tokens=200, output_tokens=40, max_batch=64)
    ctx = 220
    assert p.prefill_s_per_token == pytest.approx(model.prefill_seconds(200) / 200)
    assert p.decode_per_seq_s == pytest.approx(0.0004 + 0.0005 + 2.0e-7 * ctx)
    assert p.decode_base_s == pytest.approx(0.004)
    assert EPD_STRATEGIES.get("E+P+D") is E_P_D and EPD_STRATEGIES.names() == ["ep+d", "e+p+d", "ed+p"]
