"""The invalid-verdict budget of a stage (`judge.max_invalid_fraction`)."""

from __future__ import annotations

import pytest

from mass_ops.errors import InputError
from mass_ops.judge.invalid_verdicts import InvalidVerdictBudget, TooManyInvalidVerdictsError


def test_at_fraction_zero_the_first_invalid_verdict_fails_in_one_line() -> None:
    budget = InvalidVerdictBudget("rank task 51", max_fraction=0.0, planned=4)
    with pytest.raises(TooManyInvalidVerdictsError) as failure:
        budget.admit("task51/ranking/a_vs_b", "judge output invalid after 3 attempts\n(last: no JSON object)")
    message = str(failure.value)
    assert "\n" not in message
    assert message.startswith("rank task 51: verdict task51/ranking/a_vs_b is invalid (judge output invalid after 3")
    assert "1 invalid of 4 planned verdicts exceeds judge.max_invalid_fraction = 0 (at most 0)" in message
    assert "rerun" in message
    assert isinstance(failure.value, InputError)  # the judge's output must change, not the platform
    assert budget.invalid == 0  # the refused verdict is not counted


def test_a_fraction_allows_its_share_of_the_planned_verdicts_and_counts_earlier_runs() -> None:
    budget = InvalidVerdictBudget("search task 51", max_fraction=0.25, planned=8, already_invalid=1)
    budget.admit("v1", "bad")  # 2 of 8 = 0.25: allowed
    with pytest.raises(TooManyInvalidVerdictsError, match="3 invalid of 8 planned verdicts"):
        budget.admit("v2", "bad")
    assert budget.invalid == 2


def test_float_rounding_does_not_cost_an_allowed_verdict() -> None:
    budget = InvalidVerdictBudget("evaluate judge gpt", max_fraction=0.1, planned=30)  # 0.1 * 30 = 3.0000000000000004
    for key in ("a", "b", "c"):
        budget.admit(key, "bad")
    with pytest.raises(TooManyInvalidVerdictsError):
        budget.admit("d", "bad")


def test_fraction_one_never_fails_even_beyond_the_planned_count() -> None:
    budget = InvalidVerdictBudget("search task 51", max_fraction=1.0, planned=2)
    for key in ("v0", "v1", "champion_v0_vs_v1"):
        budget.admit(key, "bad")
    assert budget.invalid == 3


def test_a_fraction_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="within"):
        InvalidVerdictBudget("x", max_fraction=1.5, planned=1)
