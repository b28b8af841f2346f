"""The speculator's pricing of drafts (xllm.core.spec.costs): step costs by row count learned from
measurements, and the greedy plan of drafts per sequence against a hand-computed optimum."""

from __future__ import annotations

import itertools

import pytest

from xllm.core.spec.costs import OPTIMISM, SETTLED, DraftCosts, StepCosts, plan_drafts


def _costs(table: dict[int, float]) -> StepCosts:
    """Costs settled at ``table`` (each row count measured :data:`SETTLED` times)."""
    c = StepCosts()
    for rows, s in table.items():
        for _ in range(SETTLED):
            c.observe(rows, s)
    return c


def test_estimates():
    c = StepCosts()
    assert not c.known and c.estimate(3) is None
    for s in (10.0, 11.0, 50.0, 12.0, 10.5):  # one step slowed by a neighbour: the lower quartile holds
        c.observe(2, s)
    assert c.estimate(2) == 10.5
    assert c.estimate(4) == pytest.approx(c.estimate(2) * (1 + 2 * OPTIMISM))  # unseen above: optimistic
    assert c.estimate(1) == c.estimate(2)  # unseen below: never dearer than a larger step seen
    c.observe(0, 5.0)
    c.observe(3, float("nan"))
    assert sorted(c.seconds) == [2]


def test_a_slow_first_step_of_a_row_count_is_not_believed_until_settled():
    """The first step of a row count pays one-off costs (SmolLM2's first 4-row verify step measured
    94-149 ms, later ones 15 ms, one row 15 ms). Believed at once, it priced that count and every
    larger one out of every plan for good, and speculation stopped (CI)."""
    c = _costs({1: 15.0})
    c.observe(2, 94.0)
    assert c.estimate(2) == pytest.approx(15.0 * (1 + OPTIMISM))
    assert c.estimate(3) == pytest.approx(15.0 * (1 + OPTIMISM) ** 2)
    assert plan_drafts(c, 1, [("a", 4, 0.7)])  # drafting goes on, and measures 2 rows again
    c.observe(2, 12.5)
    assert c.estimate(2) == 12.5  # a faster measurement counts at once
    for _ in range(SETTLED):  # 2 rows really is dear: once settled, the measurements stand
        c.observe(2, 90.0)
    assert c.estimate(2) == 90.0
    assert plan_drafts(c, 1, [("a", 4, 0.7)]) == {}


def _expected_rate(plan: dict, rates: dict, base_rows: int, costs: StepCosts) -> float:
    tokens = base_rows + sum(sum(rates[key] ** j for j in range(1, k + 1)) for key, k in plan.items())
    return tokens / costs.estimate(base_rows + sum(plan.values()))


def test_plan_matches_brute_force():
    """On a cost curve that is flat to 3 rows and steep after (the shape measured for SmolLM2 on 2
    Zen 4 cores while the decode kernel's projections were the row-streaming GEMV), the plan reaches
    the best expected tokens per second of all plans."""
    costs = _costs({1: 10.0, 2: 10.9, 3: 11.7, 4: 16.6, 5: 18.0, 6: 19.9, 7: 24.0, 8: 27.0})
    for rates in ({"a": 0.8}, {"a": 0.95}, {"a": 0.3}, {"a": 0.05}, {"a": 0.9, "b": 0.4}, {"a": 0.6, "b": 0.6}):
        k_max = 4
        plan = plan_drafts(costs, len(rates), [(key, k_max, p) for key, p in rates.items()])
        best = max(_expected_rate(dict(zip(rates, ks, strict=True)), rates, len(rates), costs)
                   for ks in itertools.product(range(k_max + 1), repeat=len(rates)) if len(rates) + sum(ks) <= 8)
        assert _expected_rate(plan, rates, len(rates), costs) == pytest.approx(best), (rates, plan)
    assert plan_drafts(costs, 1, [("a", 4, 0.8)]) == {"a": 2}
    assert plan_drafts(costs, 1, [("a", 4, 0.05)]) == {}
    assert plan_drafts(costs, 1, [("a", 4, 0.8)], explore=True) == {"a": 3}
    assert plan_drafts(costs, 1, [("a", 1, 0.99)]) == {"a": 1}  # never above a sequence's own limit


def test_draft_costs_are_seconds_per_round_and_free_until_measured():
    d = DraftCosts()
    assert d.estimate(3) == 0.0  # unknown: drafting gets tried
    for rounds, s in ((2, 4.0), (3, 6.3), (1, 9.0), (4, 8.4)):  # the 1-round call was slowed by a neighbour
        d.observe(rounds, s)
    d.observe(0, 1.0)
    assert d.per_round == 2.0 and d.estimate(3) == 6.0


def test_plan_charges_the_drafters_rounds():
    """With the drafter's seconds per round on top of the step's, the plan for one sequence is still
    the best of all plans, and a drafter dearer than the tokens it saves plans nothing."""
    costs = _costs({1: 10.0, 2: 10.9, 3: 11.7, 4: 16.6, 5: 18.0})
    drafting = DraftCosts()
    drafting.observe(1, 2.5)
    for p in (0.95, 0.8, 0.6, 0.4, 0.3):
        plan = plan_drafts(costs, 1, [("a", 4, p)], drafting=drafting)

        def rate(k: int, p: float = p) -> float:
            return (1 + sum(p ** j for j in range(1, k + 1))) / (costs.estimate(1 + k) + drafting.estimate(k))

        assert rate(plan.get("a", 0)) == pytest.approx(max(rate(k) for k in range(5))), (p, plan)
    assert plan_drafts(costs, 1, [("a", 4, 0.95)]) == {"a": 4}  # free drafts: all four
    assert plan_drafts(costs, 1, [("a", 4, 0.95)], drafting=drafting) == {"a": 2}
    assert plan_drafts(costs, 1, [("a", 4, 0.3)]) == {"a": 1}
    assert plan_drafts(costs, 1, [("a", 4, 0.3)], drafting=drafting) == {}  # priced: not worth one
