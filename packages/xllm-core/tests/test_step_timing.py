"""The engine's step-time predictor: shapes read from a step's chunks, a profile loaded with
``--profile`` (and refused by name when bad), one observation per step with the shapes the
scheduler's chunks give (computed here by hand from the prompt lengths and the token budget), a model
fitted on the engine's own steps after a warm-up, and the predictor in the load report."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from xllm.core.step_timing import StepTiming, load_step_model
from xllm.engine_api.errors import ConfigError
from xllm.sched.latency import PerfProfile, StepSample, StepShape, StepTimeModel, predictor_from_report, step_shape
from xllm.testing.engine import make_request

TRUE = StepTimeModel((0.004, 0.0006, 2e-7, 3e-6, 1e-4))


@dataclass
class _Seq:
    num_tokens: int
    num_computed_tokens: int


def test_step_shape_reads_decodes_and_chunks() -> None:
    chunks = [(_Seq(41, 40), 1), (_Seq(100, 0), 16), (_Seq(100, 32), 16), (_Seq(1, 0), 1)]
    # a one-token chunk ending a sequence with nothing cached is a prefill of one token, not a decode
    assert step_shape(chunks) == StepShape((41,), ((0, 16), (32, 16), (0, 1)))


def _profile(tmp_path, model: StepTimeModel = TRUE) -> str:
    shapes = [StepShape((c,) * b) for b in (1, 4, 16) for c in (32, 256)]
    shapes += [StepShape((), ((k, n),)) for n in (16, 128) for k in (0, 256)]
    shapes += [StepShape((100,) * 4, ((0, 64),))]
    path = tmp_path / "profile.json"
    PerfProfile("tiny", "float32", 1, "test", 16, [StepSample(s, model.step_seconds(s)) for s in shapes]).save(path)
    return str(path)


def test_bad_profiles_are_refused_naming_the_file(tmp_path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=f"--profile {missing}: no such file"):
        load_step_model(missing)
    for text, why in (("{not json", "not a valid xllm profile"), ('{"version": 7}', "version"),
                      ('{"version": 1, "model": "m"}', "missing field"),
                      ('{"version": 1, "model": "m", "dtype": "d", "threads": 1, "machine": "x", "token_budget": 8, '
                       '"samples": []}', "at least 2")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=why) as info:
            load_step_model(bad)
        assert str(bad) in str(info.value)
    assert load_step_model(_profile(tmp_path)).coefficients == pytest.approx(TRUE.coefficients, rel=1e-4)


def test_engine_with_a_bad_profile_names_it(new_engine, tmp_path) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text("[]")
    with pytest.raises(ConfigError, match=r"broken\.json"):
        new_engine(profile_path=str(bad))


def _expected_shapes() -> list[StepShape]:
    """Requests A (10-token prompt, 3 outputs) and B (20 tokens, 2 outputs) arrive together; budget 16,
    decodes first, then prefill chunks in arrival order (xllm.sched.batch_policy)."""
    return [
        StepShape((), ((0, 10), (0, 6))),    # A whole, B's first 6 under the budget; A samples
        StepShape((11,), ((6, 14),)),        # A decodes (10 + 1), B's last 14; B samples
        StepShape((12, 21), ()),             # A's 3rd token, B's 2nd: both finish
    ]


def test_engine_observes_every_step_with_its_shape(new_engine, scheduling, tiny_model, tmp_path) -> None:
    eng = new_engine(tiny_model, max_num_batched_tokens=16, profile_path=_profile(tmp_path))
    assert eng.step_timing.profiled
    assert eng.step_timing.model.coefficients == pytest.approx(TRUE.coefficients, rel=1e-4)
    seen: list[StepSample] = []
    eng.step_timing.listeners.append(seen.append)
    eng.add_request(make_request("a", list(range(3, 13)), max_tokens=3))
    eng.add_request(make_request("b", list(range(20, 40)), max_tokens=2))
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
    assert [s.shape for s in seen] == _expected_shapes()
    assert eng.counters.steps == len(seen) and eng.step_timing.observed == len(seen)
    assert all(s.seconds > 0 for s in seen)
    report = eng.load_report().step_predictor
    assert report.token_budget == 16  # the chunking its predictions of a prefill assume
    assert report.profiled and report.correction == pytest.approx(eng.step_timing.factor)
    assert list(report.coefficients) == pytest.approx(TRUE.coefficients, rel=1e-4)
    assert report.prediction_error > 0
    model = predictor_from_report(report)
    shape = StepShape((64,) * 8)
    assert model.step_seconds(shape) == pytest.approx(eng.step_timing.step_seconds(shape), rel=1e-5)


def test_no_profile_fits_its_own_model_after_warm_up() -> None:
    timing = StepTiming(min_samples=8, refit_every=4, warmup=3)
    assert timing.step_seconds(StepShape((10,))) is None and not timing.report().coefficients
    shapes = [StepShape((c,) * b) for b in (1, 2, 8) for c in (16, 64, 256)]
    shapes += [StepShape((), ((k, n),)) for n in (16, 64) for k in (0, 128)] + [StepShape((50,) * 4, ((0, 64),))]
    for i in range(3):  # the warm-up: a first step that took far too long is never fitted
        assert timing.observe(shapes[i], 5.0) is None
    assert timing.step_seconds(shapes[0]) is None
    errors = [timing.observe(s, TRUE.step_seconds(s)) for s in shapes * 2]
    assert errors[0] is None and errors[-1] is not None and errors[-1] < 1e-6
    for s in shapes:
        assert timing.step_seconds(s) == pytest.approx(TRUE.step_seconds(s), rel=1e-4)
    report = timing.report()
    assert not report.profiled and list(report.coefficients) == pytest.approx(TRUE.coefficients, rel=1e-3)
    assert timing.observe(StepShape(), 1.0) is None  # an empty step is nothing to learn from


def test_profiled_prediction_follows_a_slower_instance() -> None:
    timing = StepTiming(TRUE, alpha=0.2)
    shape = StepShape((128,) * 16)
    first = timing.observe(shape, 2 * TRUE.step_seconds(shape))
    assert first == pytest.approx(0.5)
    for _ in range(60):
        timing.observe(shape, 2 * TRUE.step_seconds(shape))
    assert timing.factor == pytest.approx(2.0, rel=1e-3)
    assert timing.step_seconds(shape) == pytest.approx(2 * TRUE.step_seconds(shape), rel=1e-3)
    assert timing.model is not None and timing.model.coefficients == TRUE.coefficients  # the profile stays


def test_totals_of_measured_and_predicted_seconds() -> None:
    """The report's totals count the steps that had a prediction, each with the uncorrected model's
    prediction: their ratio over a window is that window's correction (what `benchmarks sim-validate`
    scales a simulation by), not the correction's recent EWMA, nor 1 as the corrected predictions,
    which follow the measurements, would make it."""
    timing = StepTiming(TRUE, alpha=0.5)
    a, b = StepShape((128,) * 16), StepShape((), ((0, 256),))
    for shape, slowdown in ((a, 1.0), (b, 3.0), (a, 1.0), (a, 2.0)):
        timing.observe(shape, slowdown * TRUE.step_seconds(shape))
    report = timing.report()
    measured = 4 * TRUE.step_seconds(a) + 3 * TRUE.step_seconds(b)  # a: 1 + 1 + 2 times its model's time
    assert report.measured_seconds == pytest.approx(measured)
    assert report.predicted_seconds == pytest.approx(3 * TRUE.step_seconds(a) + TRUE.step_seconds(b))
    assert StepTiming().report().measured_seconds == 0.0  # no model: no prediction, nothing counted
