"""``xllm profile`` on a tiny random Llama: it writes a loadable profile whose shapes are the grid's
(checked point by point against the grid the command was given) and whose fit predicts its own
samples (loosely: the machine is shared); an engine started with ``--profile`` on it uses it."""

from __future__ import annotations

import json
import pathlib

import pytest

from xllm.engine.profiler import QUICK_GRID, GridPoint, ProfileGrid
from xllm.gateway.cli import main
from xllm.models import resolve_model
from xllm.sched.latency import PerfProfile, relative_errors
from xllm.testing.models import save_tiny_llama

ENGINE = ["--dtype", "float32", "--threads", "1", "--max-num-seqs", "8", "--kv-cache-memory", "0.25",
          "--max-num-batched-tokens", "64", "--no-progress", "--log-level", "warning"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> pathlib.Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", resolve_model())


@pytest.fixture(scope="module")
def profiled(tiny, tmp_path_factory) -> tuple[pathlib.Path, str]:
    out = tmp_path_factory.mktemp("profile") / "tiny.json"
    assert main(["profile", "--model", str(tiny), *ENGINE, "--quick", "-o", str(out)]) == 0
    return out, str(tiny)


def _expected_points(grid: ProfileGrid, max_seqs: int, budget: int) -> list[GridPoint]:
    """The quick grid's points, written from the grid's definition (every point fits this engine)."""
    points = [GridPoint("prefill", chunk=n, cached=k) for k in grid.prefill_cached for n in grid.prefill_chunks]
    for c in grid.decode_contexts:
        for b in grid.batches:
            if b > 1 and b * c > grid.ladder_tokens:
                break
            points.append(GridPoint("decode", batch=b, context=c))
            points += [GridPoint("mixed", batch=b, context=c, chunk=n) for n in grid.mixed_chunks
                       if b < max_seqs and b + n <= budget]
    return points


def test_profile_writes_the_grid_and_a_fit(profiled) -> None:
    path, _ = profiled
    profile = PerfProfile.load(path)
    assert profile.dtype == "float32" and profile.threads == 1 and profile.token_budget == 64
    assert profile.weights == ""  # float weights (a quantized engine's profile names their format)
    points = _expected_points(QUICK_GRID, 8, 64)
    assert len(profile.samples) == len(points)
    for point, sample in zip(points, profile.samples, strict=True):
        shape = sample.shape
        if point.kind == "prefill":  # the prefix is block-aligned (64 tokens), so all of it is cached
            assert shape.decode_contexts == () and shape.prefill_chunks == ((point.cached, point.chunk),), point
        else:
            assert len(shape.decode_contexts) == point.batch, point
            assert all(point.context < c <= point.context + 64 for c in shape.decode_contexts), point
            want = ((0, point.chunk),) if point.kind == "mixed" else ()
            assert shape.prefill_chunks == want, point
    model = profile.fit()
    assert json.loads(path.read_text())["model_fit"] == pytest.approx(model.to_dict())
    errors = sorted(relative_errors(model, profile.samples))
    assert errors[len(errors) // 2] < 1.0  # loose: millisecond steps on a shared machine


def test_engine_uses_the_profile(profiled, caplog) -> None:
    from xllm.core.step_timing import load_step_model
    from xllm.engine.config import engine_config
    from xllm.engine.loader import load_engine
    from xllm.gateway.cli import build_parser

    path, model_dir = profiled
    args = build_parser().parse_args(["engine", "--model", model_dir, *ENGINE, "--profile", str(path)])
    loaded = load_engine(args.model, "tiny", engine_config(args), "e0", progress=False)
    try:
        timing = loaded.engine.step_timing
        assert timing.profiled and timing.model == load_step_model(path)
        assert list(loaded.engine.load_report().step_predictor.coefficients) == pytest.approx(
            timing.model.coefficients)
        assert "measured on another engine" not in caplog.text
    finally:
        loaded.compute.call(loaded.engine.close)
        loaded.compute.shutdown()
    # a profile of another kind of engine is used, with a warning naming the difference
    other = PerfProfile.load(path)
    other.weights, other.threads = "q4_1", 2
    other.save(path.parent / "other.json")
    args = build_parser().parse_args(["engine", "--model", model_dir, *ENGINE, "--profile",
                                      str(path.parent / "other.json")])
    loaded = load_engine(args.model, "tiny", engine_config(args), "e1", progress=False)
    loaded.compute.call(loaded.engine.close)
    loaded.compute.shutdown()
    assert "weights float (profile: q4_1), threads 1 (profile: 2)" in caplog.text


def test_bad_grid_and_bad_profile_are_errors(tiny, tmp_path, capsys) -> None:
    for flag, value in (("--reps", "0"), ("--decode-contexts", "1,x"), ("--prefill-cached", "-4")):
        with pytest.raises(SystemExit):
            main(["profile", "--model", str(tiny), *ENGINE, flag, value])
    assert flag in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1}')
    assert main(["profile", "--model", str(tiny), *ENGINE, "--quick", "--profile", str(bad),
                 "-o", str(tmp_path / "x.json")]) == 2
    assert f"--profile {bad}" in capsys.readouterr().err


def test_default_output_names_quantized_weights(monkeypatch, tmp_path) -> None:
    from xllm.engine.profiler import default_output

    monkeypatch.setenv("XLLM_CACHE_DIR", str(tmp_path))
    assert default_output("SmolLM2-135M-Instruct", "bfloat16", 2).name == "SmolLM2-135M-Instruct-bfloat16-t2.json"
    path = default_output("SmolLM2-135M-Instruct", "bfloat16", 2, "q4_1")
    assert path.name == "SmolLM2-135M-Instruct-bfloat16-q4_1-t2.json" and path.parent.name == "profiles"
