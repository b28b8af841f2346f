"""The step-time model: an exact fit recovers its generator, predictions compose as documented,
profiles round-trip, online correction follows a drifted instance."""

import math
from dataclasses import dataclass

import pytest

from xllm.sched.latency import (
    OnlineCorrection,
    PerfProfile,
    StepSample,
    StepShape,
    StepTimeModel,
    fit_step_model,
    lifetime_tpot,
    predictor_from_report,
    prefill_share,
    relative_errors,
)

TRUE = StepTimeModel((0.004, 0.0006, 2e-7, 3e-6, 1e-4))


def _shapes() -> list[StepShape]:
    shapes = []
    for b in (1, 4, 16, 64):
        for ctx in (32, 256, 1024):
            shapes.append(StepShape((ctx,) * b))
    for n in (16, 128, 512):
        for cached in (0, 256):
            shapes.append(StepShape((), ((cached, n),)))
            shapes.append(StepShape((100,) * 8, ((cached, n),)))
    return shapes


def test_exact_fit_recovers_generator() -> None:
    samples = [StepSample(s, TRUE.step_seconds(s)) for s in _shapes()]
    fitted = fit_step_model(samples)
    for got, want in zip(fitted.coefficients, TRUE.coefficients, strict=True):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-12)
    assert max(relative_errors(fitted, samples)) < 1e-4


def test_negative_coefficients_are_clamped() -> None:
    # a generator with a negative attention term cannot be represented: the fit keeps all >= 0
    samples = [StepSample(s, max(0.001, 0.01 + 0.001 * s.tokens - 1e-6 * s.features()[2])) for s in _shapes()]
    fitted = fit_step_model(samples)
    assert all(c >= 0 for c in fitted.coefficients)


def test_ttft_quadratic_and_tpot_linear() -> None:
    c0, c1, c2, c3, c4 = TRUE.coefficients
    n = 300
    assert TRUE.ttft(n) == pytest.approx(c0 + c1 * n + c2 * n * n / 2 + c4)
    # chunked under a budget of 128: three steps (128, 128, 44) over a growing cache
    chunked = TRUE.ttft(n, token_budget=128)
    manual = sum(TRUE.step_seconds(StepShape((), ((done, k),))) for done, k in ((0, 128), (128, 128), (256, 44)))
    assert chunked == pytest.approx(manual)
    assert TRUE.decode_seconds(10, 5000) == pytest.approx(c0 + (c1 + c4) * 10 + c3 * 5000)
    # queued work ahead adds its own prefill time
    assert TRUE.ttft(n, queued_prefill_tokens=200) == pytest.approx(TRUE.ttft(200) + TRUE.ttft(n))


def test_lifetime_tpot_stretches_the_decode_step_by_the_prefill_riding_along() -> None:
    """A life of N tokens takes N decode steps plus the prompts computed meanwhile (share of the time
    of the steps that carry decode rows): TPOT = step / (1 - share). The oracle: the time of a
    simulated life (steps written out) over its tokens."""
    _, c1, c2, _, c4 = TRUE.coefficients
    decode = StepShape((500,) * 8)
    mixed = StepShape((500,) * 8, ((0, 256),))
    lone = StepShape((), ((0, 512),))  # nobody decodes in it: nobody's TPOT
    riding = c1 * 256 + c2 * 256 * 128 + c4
    # a life of 40 tokens: 30 plain decode steps and 10 carrying a 256-token prompt chunk
    shapes = [decode] * 30 + [mixed] * 10 + [lone] * 5
    share = prefill_share(TRUE, shapes)
    life = 30 * TRUE.step_seconds(decode) + 10 * TRUE.step_seconds(mixed)
    assert share == pytest.approx(10 * riding / life)
    assert lifetime_tpot(TRUE, 8, 500, share) == pytest.approx(life / 40)
    assert lifetime_tpot(TRUE, 8, 500) == pytest.approx(TRUE.decode_seconds(8, 4000))
    assert prefill_share(TRUE, [lone]) == 0.0 and prefill_share(TRUE, []) == 0.0
    assert lifetime_tpot(TRUE, 1, 10, 5.0) == pytest.approx(TRUE.decode_seconds(1, 10) / 0.1)  # share capped


def test_profile_round_trip_and_validation(tmp_path) -> None:
    samples = [StepSample(s, TRUE.step_seconds(s)) for s in _shapes()]
    prof = PerfProfile("smollm2", "bfloat16", 2, "test", 512, samples, created=1.0)
    path = tmp_path / "p.json"
    prof.save(path)
    back = PerfProfile.load(path)
    assert back.samples == samples and back.token_budget == 512
    assert back.fit().coefficients == pytest.approx(prof.fit().coefficients)
    bad = path.read_text().replace('"version": 1', '"version": 99')
    with pytest.raises(ValueError, match="version"):
        PerfProfile.from_json(bad)
    with pytest.raises(ValueError, match="positive"):
        StepSample.from_dict({"decode_contexts": [1], "seconds": -1})
    with pytest.raises(ValueError):
        StepTimeModel((1.0, -1.0, 0, 0, 0))


def test_online_correction_follows_drift() -> None:
    corr = OnlineCorrection(TRUE, alpha=0.2)
    shape = StepShape((128,) * 16)
    for _ in range(60):
        corr.observe(shape, 1.5 * TRUE.step_seconds(shape))
    assert corr.factor == pytest.approx(1.5, rel=1e-3)
    assert corr.step_seconds(shape) == pytest.approx(1.5 * TRUE.step_seconds(shape), rel=1e-3)
    corr.observe(shape, math.nan)  # ignored
    assert corr.observations == 60


@dataclass
class _Report:  # the fields of a load report's StepTimePredictor that the gateway reads
    coefficients: tuple[float, ...] = ()
    correction: float = 0.0


def test_predictor_from_report_applies_the_reported_correction() -> None:
    assert predictor_from_report(_Report()) is None  # no model yet
    shape = StepShape((128,) * 16, ((0, 64),))
    corrected = predictor_from_report(_Report(TRUE.coefficients, 1.5))
    assert corrected.step_seconds(shape) == pytest.approx(1.5 * TRUE.step_seconds(shape))
    assert predictor_from_report(_Report(TRUE.coefficients, 0.0)) == TRUE  # no correction reported: 1


def test_with_chunk_builds_the_shape_step_shape_reads() -> None:
    """Adding chunks one at a time (the co-location policy's running shape) gives what step_shape reads
    of all of them: decode rows (one token at the end of a sequence with KV) with their context,
    anything else a prefill chunk over what is cached."""
    from dataclasses import dataclass

    from xllm.sched.latency import step_shape

    @dataclass
    class Seq:
        num_tokens: int
        num_computed_tokens: int

    chunks = [(Seq(10, 9), 1), (Seq(40, 0), 16), (Seq(5, 4), 1), (Seq(30, 20), 1), (Seq(1, 0), 1),
              (Seq(64, 32), 8)]
    shape = StepShape()
    for seq, n in chunks:
        shape = shape.with_chunk(seq, n)
    assert shape == step_shape(chunks)
    assert shape.decode_contexts == (10, 5) and shape.prefill_chunks == ((0, 16), (20, 1), (0, 1), (32, 8))


def test_prefill_seconds_is_the_sum_of_its_chunk_steps():
    """The closed form equals timing each chunk's step with step_seconds: the chunk after what is
    cached and computed so far, beside decode_batch rows of decode_context // decode_batch tokens."""
    import random

    model = StepTimeModel((0.02, 5.6e-4, 3e-7, 2.1e-6, 1.6e-4))
    rng = random.Random(0)
    for _ in range(2000):
        n, cached, budget = rng.randint(0, 3000), rng.randint(0, 2000), rng.choice([0, 64, 512, 2048])
        rows, context = rng.randint(0, 70), rng.randint(0, 50000)
        per_step = max(budget - rows if budget else n, 1)
        expected, done = 0.0, 0
        while done < n:
            k = min(per_step, n - done)
            decodes = (context // rows,) * rows if rows else ()
            expected += model.step_seconds(StepShape(decodes, ((cached + done, k),)))
            done += k
        assert model.prefill_seconds(n, cached, budget, rows, context) == pytest.approx(expected, rel=1e-12, abs=1e-15)
