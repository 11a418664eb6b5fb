"""The TokenReview budget: per caller and in total, refilled at its rate, a burst of 10 s."""

from __future__ import annotations

import pytest

from kvgrid.common.pod_tokens import ReviewBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_caller_gets_its_burst_then_its_rate_and_others_are_untouched() -> None:
    clock = Clock()
    budget = ReviewBudget(0.5, 0, clock=clock)  # a burst of 5
    assert [budget.take("attacker@10.0.0.9") for _ in range(5)] == [None] * 5
    refusal = budget.take("attacker@10.0.0.9")
    assert refusal is not None and "0.5 per second from this caller (agent_token_reviews_per_s)" in refusal
    assert budget.take("agent@10.0.0.2") is None  # another pod's own bucket
    clock.now += 1.9
    assert budget.take("attacker@10.0.0.9") is not None  # 0.95 reviews refilled: not yet one
    clock.now += 0.1
    assert budget.take("attacker@10.0.0.9") is None
    assert budget.refused == 2


def test_the_total_caps_all_callers_together() -> None:
    clock = Clock()
    budget = ReviewBudget(0, 0.2, clock=clock)  # a burst of 2 over everyone
    assert budget.take("a") is None and budget.take("b") is None
    refusal = budget.take("c")
    assert refusal is not None and "agent_token_reviews_total_per_s" in refusal
    clock.now += 5
    assert budget.take("c") is None


def test_a_refused_review_costs_nothing_and_no_limit_is_zero() -> None:
    clock = Clock()
    budget = ReviewBudget(0.1, 0.1, clock=clock)  # bursts of 1
    assert budget.take("a") is None
    for _ in range(50):
        assert budget.take("a") is not None  # refusals do not push the refill further out
    clock.now += 10
    assert budget.take("a") is None
    unlimited = ReviewBudget(0, 0, clock=clock)
    assert all(unlimited.take("a") is None for _ in range(10_000))


def test_forgotten_callers_are_bounded_and_start_full() -> None:
    budget = ReviewBudget(0.1, 0, max_callers=3, clock=Clock())
    for caller in "abcd":
        assert budget.take(caller) is None
    assert budget.take("d") is not None
    assert budget.take("a") is None  # "a" was the least recently used of four: forgotten, full again


@pytest.mark.parametrize("rate", [-1.0, float("nan")])
def test_a_negative_or_nan_rate_is_refused_naming_it(rate: float) -> None:
    with pytest.raises(ValueError, match=r"per_caller_per_s=.*expected reviews per second >= 0"):
        ReviewBudget(rate, 1)
