import pytest

from benchmarks.sweep import find_max_rate


def step_attainment(capacity):
    """A synthetic monotone attainment curve: ~1 below ``capacity`` req/s, falling linearly after it."""
    calls = []

    def f(rate):
        calls.append(rate)
        return 1.0 if rate <= capacity else max(0.0, 1.0 - (rate - capacity) / capacity)
    return f, calls


@pytest.mark.parametrize("capacity", [0.3, 1.0, 3.7, 20.0])
def test_finds_boundary_within_tolerance(capacity):
    f, calls = step_attainment(capacity)
    # attainment >= 0.9 up to 1.1 x capacity
    res = find_max_rate(f, 0.9, start=1.0, rel_tol=0.05, max_evals=20)
    boundary = 1.1 * capacity
    assert res.best_rate <= boundary + 1e-9
    assert res.best_rate >= boundary / 1.05 - 1e-9
    assert res.first_failing_rate > boundary
    assert len(calls) == len(set(calls)) == len(res.points)  # no rate evaluated twice


def test_budget_is_respected():
    f, calls = step_attainment(50.0)
    res = find_max_rate(f, 0.9, start=1.0, rel_tol=0.01, max_evals=4)
    assert len(calls) == 4
    assert res.best_rate == 8.0 and res.first_failing_rate is None


def test_never_meets_target():
    res = find_max_rate(lambda r: 0.5, 0.9, start=1.0, min_rate=0.1, max_evals=10)
    assert res.best_rate is None
    assert min(r for r, _ in res.points) == pytest.approx(0.1)


def test_always_meets_target_stops_at_max_rate():
    res = find_max_rate(lambda r: 1.0, 0.9, start=1.0, max_rate=16.0, max_evals=10)
    assert res.best_rate == 16.0 and res.first_failing_rate is None
    assert [r for r, _ in res.sorted_points] == [1.0, 2.0, 4.0, 8.0, 16.0]


def test_invalid_arguments():
    with pytest.raises(ValueError):
        find_max_rate(lambda r: 1.0, 0.0)
    with pytest.raises(ValueError):
        find_max_rate(lambda r: 1.0, 0.9, start=0.01, min_rate=0.05)
