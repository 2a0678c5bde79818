"""Admission of a Kubernetes episode pod against the cycle's shared budgets, checked before the pod is created.

An episode pod's proxy reaches no metadata store, so it holds only the episode's own token budget. The operator that
creates the pod holds the store credentials: it asks `admit_episode` first. When the episode's task or the cycle has
no room left (`BudgetLedger.exhausted`, the rule the local `EpisodePool` applies before starting an attempt), no pod
is created and the unit is recorded as a `budget_exhausted` attempt — the status a budget-stopped attempt has on the
local backend, with its failure document (`subtype` budget_exhausted, `budget` naming the scope and the setting to
raise) and `not_started` set — so `status` and `repair` show it and a rerun after raising the budget runs the unit
as its next attempt, linked to this one. Asking again while the scope stays exhausted records nothing new.

What a pod spends is charged to the same scopes when its publisher records the episode
(`mass_ops.runtime.handoff`), so the overshoot of a task or cycle budget is bounded by (pods in flight for the scope)
x `budgets.episode_tokens` (see `mass_ops.store.budgets`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from mass_ops.context import CycleContext
from mass_ops.runtime.episode import EpisodeIdentity, EpisodeRequest, describe
from mass_ops.store.budgets import BudgetLedger, BudgetLimits, Refusal, episode_scopes
from mass_ops.store.schema import Episode

logger = logging.getLogger(__name__)

FINAL_STATUSES = ("succeeded", "model_failure")
BUDGET_SUBTYPE = "budget_exhausted"  # the failure subtype a budget-stopped attempt carries (runtime.outcome)


@dataclass(frozen=True)
class BudgetStop:
    """An episode that was not started because a budget of its scopes is exhausted, and the attempt recording it."""

    episode: str  # e.g. `collection episode t51 c2`
    episode_id: int
    attempt: int
    scope: str
    setting: str  # the config key to raise
    message: str  # one line: which budget, how much is spent, what to raise

    def as_dict(self) -> dict[str, Any]:
        return {"status": "budget_exhausted", **dataclasses.asdict(self)}


def admit_episode(
    ctx: CycleContext, identity: EpisodeIdentity, request_of: Callable[[], EpisodeRequest]
) -> BudgetStop | None:
    """None when the episode may start (no limited scope, room left, or the unit is already final); else record it
    as a not-started `budget_exhausted` attempt (once per exhausted spell) and return why. `request_of` builds the
    unit's exact request (its stage knows how); it is called only when a budget refuses."""
    limits = BudgetLimits.from_mapping(ctx.config.budgets.model_dump())
    scopes = episode_scopes(identity.task_id)
    if not limits.limited(scopes):
        return None
    refused = BudgetLedger(ctx.repo, ctx.cycle_id, limits).exhausted(scopes)
    if refused is None:
        if limits.episode_tokens is None:
            logger.warning(
                "%s: budgets.episode_tokens is not set, so a pod's spend is unbounded until it ends: the task and "
                "cycle budgets hold only at pod admission",
                describe(identity),
            )
        return None
    request = request_of()
    attempts = ctx.repo.episode_attempts(ctx.cycle_id, **request.unit.identity())
    if any(row.status in FINAL_STATUSES for row in attempts):
        return None  # nothing left to run: the operator reuses the recorded episode
    last = attempts[-1] if attempts else None
    if last is not None and last.status == "budget_exhausted" and (last.failure or {}).get("not_started"):
        row = last  # the same stop, asked again: no new attempt
    else:
        row = _record_not_started(ctx, request, last, refused)
    stop = BudgetStop(describe(identity), row.id, row.attempt, refused.scope, refused.setting, refused.message)
    logger.warning(
        "%s: not started (attempt %d recorded budget_exhausted): %s", stop.episode, row.attempt, stop.message
    )
    return stop


def _record_not_started(ctx: CycleContext, request: EpisodeRequest, last: Episode | None, refused: Refusal) -> Episode:
    """The attempt's status document (artifact first), then its row: attempt last+1, linked to the previous one."""
    unit = dataclasses.replace(request.unit, attempt=last.attempt + 1 if last else 1)
    now = datetime.now(UTC)
    failure = {
        "subtype": BUDGET_SUBTYPE,
        "message": f"not started: {refused.message}",
        "budget": dataclasses.asdict(refused),
        "refused_requests": 0,
        "not_started": True,
    }
    status = {
        "started_at": now.isoformat(),
        "finished_at": now.isoformat(),
        "model": ctx.config.models.served_name,
        "endpoint": ctx.config.inference.endpoint,
        "seed": unit.seed,
        "exit_code": None,
        "trace_has_success_result": False,
        "failure": failure,
        "hiw": {"condition": request.condition, "api_requests": 0, "mass": True},
        "status": "budget_exhausted",
        "unit": unit.key,
        "attempt": unit.attempt,
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "requests": 0, "max_prompt_tokens": 0},
        "terminated_by": None,
    }
    published = ctx.artifacts.put_json(unit.artifact_key("status"), status)
    return ctx.repo.record_episode(
        ctx.cycle_id,
        task_id=unit.task_id,
        kind=unit.kind,
        seed=unit.seed,
        status="budget_exhausted",
        attempt=unit.attempt,
        version=unit.version,
        candidate=unit.candidate,
        generation=request.generation,
        condition=request.condition,
        model=ctx.config.models.served_name,
        failure=failure,
        prompt_sha256=request.prompt_sha256,
        prompt_tokens=0,
        completion_tokens=0,
        requests=0,
        max_prompt_tokens=0,
        started_at=now,
        finished_at=now,
        artifacts={"status": published.uri},
        artifact_sha256={"status": published.sha256},
        retry_of_id=last.id if last else None,
    )
