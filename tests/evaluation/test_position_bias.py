"""Flip rates of judges (position bias): hand-made order checks with known flips, and the rank stage's sampled
pairs read back from the call ledger, their verdicts still the forward calls'."""

from __future__ import annotations

import pytest

from mass_ops.config import validate_config
from mass_ops.evaluation.position_bias import OrderCheck, flip_rate, flip_rates, order_checks, stage_and_judge
from mass_ops.judge.pairwise import in_position_bias_sample
from mass_ops.llm.calls import CallLedger
from mass_ops.stages.collect import collect_batch
from mass_ops.stages.rank import rank_tasks
from tests.inner_loop_fakes import (  # noqa: F401
    FakeExecutor,
    InnerLoopEnv,
    fast_client,
    inner_loop_fixture,
    open_test_cycle,
)
from tests.stages.test_collect import retain


def check(forward: str | None, back: str | None, judge: str = "gpt", stage: str = "evaluate") -> OrderCheck:
    return OrderCheck(stage, judge, "k", forward, back)  # type: ignore[arg-type]


def test_flips_reversals_and_ties_are_counted_as_documented() -> None:
    checks = [
        check("A", "B"),  # reversal: the first-shown workspace won both times
        check("A", "B"),
        check("B", "A"),  # reversal: the second-shown one won both times
        check("tie", "A"),  # a tie in one order only: a flip, not a reversal
        check("A", "A"),
        check("B", "B"),
        check("tie", "tie"),  # a tie in both orders is consistent
        check("A", "A"),
        check("B", "B"),
        check("A", None),  # the swapped answer was invalid: nothing to compare
    ]
    rate = flip_rate(checks, stage="evaluate", judge="gpt")
    assert (rate.checked, rate.flips, rate.reversals, rate.first_shown_won_twice, rate.unusable) == (9, 4, 3, 2, 1)
    assert rate.rate == pytest.approx(4 / 9)
    # Wilson 95% of 4 in 9, computed by hand: centre (p + z²/2n)/(1 + z²/n), half-width z·√(p(1−p)/n + z²/4n²)/(…).
    assert rate.wilson == pytest.approx((0.188779, 0.733349), abs=1e-6)
    assert rate.as_dict()["wilson_95"] == pytest.approx([0.188779, 0.733349], abs=1e-6)
    none = flip_rate([check("A", "A")] * 3)
    assert (none.rate, none.wilson) == (0.0, pytest.approx((0.0, 0.561497), abs=1e-6))
    empty = flip_rate([check(None, "A")])
    assert (empty.checked, empty.rate, empty.wilson, empty.unusable) == (0, None, None, 1)


def test_flip_rates_are_grouped_per_stage_and_judge_in_cycle_order() -> None:
    checks = [
        check("A", "B", judge="opus"),
        check("A", "A", judge="gpt"),
        check("A", "B", judge="L0", stage="rank: self-judge"),
        check("B", "B", judge="L0", stage="search: vs reference"),
    ]
    rows = [(r.stage, r.judge, r.checked, r.flips) for r in flip_rates(checks)]
    assert rows == [
        ("search: vs reference", "L0", 1, 0),
        ("rank: self-judge", "L0", 1, 1),
        ("evaluate", "gpt", 1, 0),
        ("evaluate", "opus", 1, 1),
    ]
    assert stage_and_judge("eval/external/p1/gpt-judge/42", "gpt-5") == ("evaluate", "gpt-judge")
    assert stage_and_judge("task51/champion/champion_v0_vs_v1", "L0") == ("search: arbitration", "L0")
    assert stage_and_judge("task51/optimizer/v0_to_v1", "L0") is None


WINNERS = ("A", "B", "tie")


def test_the_rank_stage_measures_flips_without_changing_a_verdict(inner_loop: InnerLoopEnv) -> None:
    # The judge answers with a function of the seed only; both presentations of a pair share its seed, so the
    # swapped call gives the same raw answer: a decisive verdict flips, a tie does not.
    inner_loop.policy.judge_winner = lambda request: WINNERS[request.seed % 3]
    data = inner_loop.config(tasks=(51,), candidates=6, train_ranks=2).model_dump(mode="json")
    data["judge"]["position_bias_sample"] = 0.5
    config = validate_config(data)
    ctx = open_test_cycle(config)
    client = fast_client(config)
    inner_loop.clients.append(client)
    retain(ctx, 51, 1)
    collect_batch(ctx, FakeExecutor(ctx))
    rank_tasks(ctx, client=client)

    rows = ctx.repo.comparisons(ctx.cycle_id, "ranking")
    # Every recorded verdict is the forward call's answer, sampled or not (swap-consistent judging would have
    # turned the sampled decisive ones into ties).
    assert rows and all(row.verdict == WINNERS[row.seed % 3] for row in rows)
    sampled = [row for row in rows if in_position_bias_sample(f"task51/ranking/{row.key}", 0.5)]
    assert 0 < len(sampled) < len(rows)
    assert len(inner_loop.judge_requests()) == len(rows) + len(sampled)

    ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name)
    checks = order_checks(ledger, ctx.repo.llm_calls(ctx.cycle_id))
    assert sorted(c.unit_key for c in checks) == sorted(f"task51/ranking/{row.key}" for row in sampled)
    assert all(c.stage == "rank: self-judge" and c.judge == config.models.served_name for c in checks)
    (rate,) = flip_rates(checks)
    assert rate.checked == len(sampled)
    assert rate.flips == rate.reversals == sum(1 for row in sampled if row.verdict != "tie")
    assert rate.first_shown_won_twice == sum(1 for row in sampled if row.verdict == "A")

    # A rerun judges nothing again: both presentations of every sampled pair are reused from the ledger.
    before = len(inner_loop.judge_requests())
    rank_tasks(ctx, client=client)
    assert len(inner_loop.judge_requests()) == before
