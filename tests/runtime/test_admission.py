"""Budget admission of a Kubernetes episode pod (`runtime.admission`), against the real metadata store: an exhausted
task or cycle scope records the unit as a not-started `budget_exhausted` attempt instead of a pod, once; a raised
budget admits it again; pods' spend charged at ingest stops the other tasks of a shared cycle budget; and the
overshoot of a scope stays within (pods in flight) x the episode budget each pod's own proxy enforces."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from mass_ops.compute.kubernetes import EpisodeSpec
from mass_ops.context import CycleContext
from mass_ops.runtime.admission import admit_episode
from mass_ops.runtime.proxy import EpisodeBudget
from mass_ops.stages.units import episode_request
from mass_ops.store.budgets import BudgetLedger, BudgetLimits, Refusal, charge_episode, episode_scopes
from tests.inner_loop_fakes import InnerLoopEnv, inner_loop_fixture  # noqa: F401

REFERENCE_51 = EpisodeSpec("reference", 51)
REFERENCE_202 = EpisodeSpec("reference", 202)


def _admit(ctx, identity):
    """Admission as the pod operator asks it: the unit's request built by its stage."""
    return admit_episode(ctx, identity, lambda: episode_request(ctx, identity))


def with_budgets(ctx: CycleContext, **budgets: Any) -> CycleContext:
    """The same cycle under other budgets (budgets are not part of the config hash: raising one continues it)."""
    from mass_ops.config import validate_config

    data = ctx.config.model_dump(mode="json")
    data["budgets"] = {**data.get("budgets", {}), **budgets}
    return dataclasses.replace(ctx, config=validate_config(data))


def test_an_exhausted_task_budget_records_the_unit_not_started_once(inner_loop: InnerLoopEnv) -> None:
    ctx = inner_loop.open(tasks=(51, 202)).ctx
    ctx = with_budgets(ctx, task_tokens=1_000, episode_tokens=400)
    assert _admit(ctx, REFERENCE_51) is None, "room left: the pod may start"
    ctx.repo.add_budget_spend(ctx.cycle_id, episode_scopes(51), tokens=1_000)

    stop = _admit(ctx, REFERENCE_51)
    assert stop is not None and (stop.scope, stop.setting, stop.attempt) == ("task:51", "budgets.task_tokens", 1)
    assert stop.message.startswith("budget exhausted: task 51 has used 1,000 of budgets.task_tokens = 1,000 tokens")
    (row,) = ctx.repo.episodes(ctx.cycle_id)
    assert (row.id, row.kind, row.task_id, row.status, row.attempt) == (stop.episode_id, "reference", "51",
                                                                        "budget_exhausted", 1)  # fmt: skip
    assert row.failure["subtype"] == "budget_exhausted" and row.failure["not_started"] is True
    assert Refusal(**row.failure["budget"]).setting == "budgets.task_tokens"  # what the pool reads back
    assert (row.prompt_tokens, row.completion_tokens, row.requests) == (0, 0, 0)
    status = json.loads(ctx.artifacts.get_bytes(row.artifacts["status"].removeprefix(ctx.artifacts.url + "/")))
    assert status["status"] == "budget_exhausted" and status["failure"] == row.failure
    # Asked again (a retried or cleared task) while still exhausted: the same stop, no second attempt.
    again = _admit(ctx, REFERENCE_51)
    assert again is not None and again.episode_id == stop.episode_id
    assert len(ctx.repo.episodes(ctx.cycle_id)) == 1
    assert _admit(ctx, REFERENCE_202) is None, "another task's scope is not touched"
    # Raised: admitted, and the pod's pool runs the unit as attempt 2 after the recorded stop.
    assert _admit(with_budgets(ctx, task_tokens=5_000), REFERENCE_51) is None
    assert len(ctx.repo.episodes(ctx.cycle_id)) == 1


def test_a_cycle_budget_shared_by_two_tasks_stops_both_once_pods_spent_it(inner_loop: InnerLoopEnv) -> None:
    ctx = with_budgets(inner_loop.open(tasks=(51, 202)).ctx, cycle_tokens=1_000, episode_tokens=600)
    # Both tasks' pods were admitted while the cycle had room, and their spend reached the ledger at ingest.
    assert _admit(ctx, REFERENCE_51) is None and _admit(ctx, REFERENCE_202) is None
    charge_episode(ctx.repo, ctx.cycle_id, 51, charge_key="e1", tokens=600, requests=3)
    assert _admit(ctx, REFERENCE_202) is None, "400 tokens left in the cycle"
    charge_episode(ctx.repo, ctx.cycle_id, 202, charge_key="e2", tokens=500, requests=2)
    stops = [_admit(ctx, REFERENCE_51), _admit(ctx, REFERENCE_202)]
    assert [(s.scope, s.setting) for s in stops if s] == [("cycle", "budgets.cycle_tokens")] * 2
    spend = ctx.repo.budget_spend(ctx.cycle_id)
    assert {scope: (row.tokens, row.requests) for scope, row in spend.items()} == {
        "cycle": (1_100, 5), "task:51": (600, 3), "task:202": (500, 2),
    }  # fmt: skip
    assert {row.status for row in ctx.repo.episodes(ctx.cycle_id)} == {"budget_exhausted"}


def pod_spend(episode_tokens: int, request_need: int) -> int:
    """What one pod spends at most: its proxy's episode budget admits requests until the next one would cross it,
    and every admitted request uses all it asked for (the worst case)."""
    budget = EpisodeBudget(episode_tokens=episode_tokens, default_max_tokens=request_need)
    spent = 0
    while budget.admit(request_need) is None:
        budget.settle(request_need, {"prompt_tokens": request_need // 2, "completion_tokens": request_need // 2})
        spent += request_need
    return spent


def test_the_overshoot_is_bounded_by_pods_in_flight_times_the_episode_budget(inner_loop: InnerLoopEnv) -> None:
    limit, episode_tokens, need = 10_000, 3_000, 700
    ctx = with_budgets(inner_loop.open(tasks=(51,)).ctx, task_tokens=limit, episode_tokens=episode_tokens)
    ledger = BudgetLedger(ctx.repo, ctx.cycle_id, BudgetLimits.from_mapping(ctx.config.budgets.model_dump()))
    # One token of room: every pod is still admitted.
    charge_episode(ctx.repo, ctx.cycle_id, 51, charge_key="before", tokens=limit - 1)
    in_flight = 4
    admitted = [_admit(ctx, EpisodeSpec("collection", 51, candidate=c)) for c in range(in_flight)]
    assert admitted == [None] * in_flight
    for pod in range(in_flight):  # each pod ends and is charged at ingest, none saw the others' spend
        charge_episode(
            ctx.repo, ctx.cycle_id, 51, charge_key=f"pod{pod}", tokens=pod_spend(episode_tokens, need), requests=1
        )
    spent = ctx.repo.budget_spend(ctx.cycle_id)["task:51"].tokens
    overshoot = spent - limit
    print(f"task budget {limit:,}: {in_flight} pods in flight spent past it by {overshoot:,} tokens "
          f"(bound {in_flight} x {episode_tokens:,} = {in_flight * episode_tokens:,})")  # fmt: skip
    assert 0 < overshoot <= in_flight * episode_tokens
    assert ledger.exhausted(episode_scopes(51)) is not None
    assert _admit(ctx, EpisodeSpec("reference", 51)) is not None, "no further pod"
