"""``--epd-strategy auto`` (:mod:`xllm.gateway.epd_auto`): the strategy follows the live instances (their pools,
their measured encode seconds and reported step models), the workload window and the SLOs; it keeps ``ep+d``
until an image's encode time is measured, re-decides only every ``refresh_s``, shows in ``xllm:epd_strategy``;
``auto`` without both SLOs is refused. Expected picks from the profiler's model worked out on the same numbers:
an encode instance takes image-heavy load off the prefill instance; at 3 req/s with 20 % images a lone prefill
instance that also encodes misses a 2 s TTFT (``ed+p`` then); a 5 ms TPOT target rules encoding on the decode
instance out (``ep+d``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from xllm.gateway.encode import EPDOptions
from xllm.gateway.epd_auto import EPDChooser, WorkloadWindow
from xllm.proto.registry.v1 import instance_pb2

COEFFICIENTS = (0.004, 0.0004, 3.1e-7, 2.0e-7, 0.0005)  # a SmolLM2-like step model (const, tokens, ..., seqs)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def instance(role: str, images: int = 0, seconds: float = 0.0, reported: bool = True):
    load = instance_pb2.LoadReport()
    if reported:
        load.step_predictor.coefficients.extend(COEFFICIENTS)
        load.step_predictor.correction = 1.0
        load.step_predictor.token_budget = 512
    counters = instance_pb2.EngineCounters(images_encoded=images, image_encode_seconds=seconds)
    return SimpleNamespace(role=role, flip=None, load=load, counters=counters)


def chooser(states, slo_tpot_s: float = 0.1, clock=None) -> tuple[EPDChooser, CollectorRegistry]:
    router = SimpleNamespace(registry=SimpleNamespace(routable=lambda model: list(states)))
    prom = CollectorRegistry()
    return EPDChooser(router, 2.0, slo_tpot_s, prom, window_s=60, refresh_s=2.0, clock=clock or Clock()), prom


def feed(c: EPDChooser, clock: Clock, rate: float, image_every: int, seconds: float = 20.0) -> None:
    """Requests of 300 prompt tokens and 32 out at ``rate``/s, one in ``image_every`` with an image."""
    for i in range(int(rate * seconds)):
        c.observe("m", int(i % image_every == 0), 300, 32)
        clock.now += 1 / rate


def test_the_workload_window():
    clock = Clock()
    w = WorkloadWindow(10.0, clock)
    assert w.mix() is None
    for i in range(20):  # 2 req/s for 10 s, every fourth with 2 images
        w.observe(2 if i % 4 == 0 else 0, 100 + i, 8)
        clock.now += 0.5
    mix = w.mix()
    assert mix.rate == pytest.approx(2.0) and mix.image_fraction == pytest.approx(0.25)
    assert mix.images_per_request == 2 and mix.prompt_tokens == pytest.approx(109.5) and mix.output_tokens == 8
    clock.now += 60
    assert w.mix() is None  # (all aged out)


@pytest.mark.parametrize(("pools", "want"), [
    (["prefill", "decode", "encode"], "e+p+d"),   # 1.5 req/s, all with images: the encode instance takes them
    (["prefill", "decode"], "ed+p"),              # the prefill instance would miss the TTFT target encoding them
])
def test_the_pick_follows_the_pools_and_the_load(pools, want):
    clock = Clock()
    states = [instance(r, images=10, seconds=5.0) for r in pools]  # 0.5 s per image, as measured
    c, prom = chooser(states, clock=clock)
    feed(c, clock, 1.5 if want == "e+p+d" else 3.0, 1 if want == "e+p+d" else 5)
    assert c.strategy("m").name == want
    assert prom.get_sample_value("xllm:epd_strategy", {"model_name": "m", "strategy": want}) == 1
    assert prom.get_sample_value("xllm:epd_strategy", {"model_name": "m", "strategy": "ep+d"}) == 0


def test_a_tight_tpot_keeps_encoding_off_the_decode_instance():
    clock = Clock()
    c, _ = chooser([instance("prefill", 10, 5.0), instance("decode", 10, 5.0)], slo_tpot_s=0.005, clock=clock)
    feed(c, clock, 0.5, 2)
    assert c.strategy("m").name == "ep+d"


def test_unmeasured_or_without_pd():
    clock = Clock()
    c, _ = chooser([instance("prefill"), instance("decode"), instance("encode")], clock=clock)  # no image encoded yet
    feed(c, clock, 1.5, 1)
    assert c.strategy("m").name == "ep+d"
    assert chooser([instance("mixed"), instance("encode")])[0].strategy("m").name == "e+p+d"  # no PD: E takes them
    assert chooser([instance("mixed")])[0].strategy("m").name == "ep+d"


def test_it_re_decides_only_every_refresh():
    clock = Clock()
    states = [instance("prefill", 10, 5.0), instance("decode", 10, 5.0)]
    c, _ = chooser(states, clock=clock)
    feed(c, clock, 3.0, 5)
    assert c.strategy("m").name == "ed+p"
    states.append(instance("encode", 10, 5.0))  # an encode instance joins ...
    clock.now += 1.0
    assert c.strategy("m").name == "ed+p"       # ... seen at the next decision, not before
    clock.now += 1.5
    assert c.strategy("m").name == "e+p+d"


def test_auto_needs_both_slos():
    with pytest.raises(ValueError, match="--slo-tpot-ms"):
        EPDOptions(None, slo_ttft_s=2.0)
    assert EPDOptions(None, slo_ttft_s=2.0, slo_tpot_s=0.1).strategy is None
