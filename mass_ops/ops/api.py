"""Cycle operations the DAG tasks and the CLI call beside the stage functions: validation with its budget gate, the
cost estimate, episode-pod admission and leases, the next cycle's overrides and the cycle's status. Same contract as
`mass_ops.stages.api`: the validated `CycleConfig` first, a small JSON-able dict back.

`STAGE_FUNCTIONS` binds every stage of `stages.registry` to its function; `repair` reruns stages through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mass_ops.config import CycleConfig
from mass_ops.context import attach_cycle, open_cycle
from mass_ops.errors import InputError
from mass_ops.stages import api as stages
from mass_ops.stages import registry
from mass_ops.stages.common import jsonable


def validate_config(config: CycleConfig, allow_over_budget: bool = False) -> dict[str, Any]:
    """Check that both stores answer (a silent or read-only store fails here, in the run's first minute, not at its
    last task), check the config against the catalogue and its cost estimate against the cycle budget (refused
    unless `allow_over_budget`), create/upgrade the schema, freeze the config into the cycle row and record the
    estimate in its provenance (the first one made: the report compares the actuals with it)."""
    from mass_ops.prompts import check_templates
    from mass_ops.store.probe import probe_stores

    config.require_catalogue()
    check_templates(config)  # bad input first: nothing is touched, not even a probe object
    estimate, summary = _budget_gate(config, allow_over_budget)
    probe_stores(config.storage.metadata_url, config.storage.artifact_url)
    ctx = open_cycle(config)
    cycle = ctx.repo.get_cycle(ctx.cycle_name)
    if cycle is not None and "estimate" not in (cycle.provenance or {}):
        ctx.repo.set_cycle_provenance(ctx.cycle_id, "estimate", jsonable(estimate.as_dict()))
    return {"cycle": ctx.cycle_name, "cycle_id": ctx.cycle_id, "config_hash": config.config_hash(), **summary}


def _budget_gate(config: CycleConfig, allow_over_budget: bool) -> tuple[Any, dict[str, Any]]:
    """The cycle's estimate and its small summary for XCom; InputError (one line) when it exceeds
    `budgets.cycle_cost_usd` or `budgets.cycle_tokens` and `allow_over_budget` is not set."""
    from mass_ops.cost.estimate import check_budget
    from mass_ops.ops.plan import build_plan, cycle_estimate
    from mass_ops.train.plan import training_command_for

    estimate = cycle_estimate(config, build_plan(config, training_command_for(config)))
    check = check_budget(estimate, config.budgets.cycle_cost_usd, config.budgets.cycle_tokens)
    if check.over_budget and not allow_over_budget:
        raise InputError(
            f"cycle {config.cycle_name}: {'; '.join(check.problems)}; raise the budget, shrink the run, or check "
            "allow_over_budget in the trigger form"
        )
    total = estimate.total
    summary = {
        "estimate": {
            "cost_usd": round(total.cost_usd, 2),
            "tokens": total.tokens,
            "gpu_hours": round(total.gpu_hours, 2),
            "wall_clock_h": round(total.wall_clock_s / 3600, 2),
            "figures": f"lineage of {estimate.lineage_cycle}" if estimate.lineage_cycle else "defaults",
            "per_stage_usd": {s.stage: round(s.cost_usd, 2) for s in estimate.stages},
        },
        "over_budget": check.over_budget,
    }
    return estimate, summary


def cycle_estimate(config: CycleConfig, allow_over_budget: bool = False) -> dict[str, Any]:
    """The cycle's cost estimate summary (what `validate_config` checks and returns), refused over budget unless
    `allow_over_budget`; touches no store beyond reading the parent cycle's records."""
    return _budget_gate(config, allow_over_budget)[1]


def estimate_summary(config: CycleConfig) -> dict[str, Any]:
    """`plan --json`'s per-stage `estimate` for `config` and its check against the cycle budget (the trigger form's
    estimate page); reads only the parent cycle's records."""
    from mass_ops.ops.plan import estimate_summary as summary

    return jsonable(summary(config))


def admit_episode(config: CycleConfig, episode: Any) -> dict[str, Any] | None:
    """Ask before creating an episode pod whether its task's and the cycle's budgets leave room (a pod's proxy has no
    store to ask): None when it may start; else the unit is recorded as a not-started `budget_exhausted` attempt and
    the stop is returned (`message` is one line naming the budget to raise). See `runtime.admission`."""
    from mass_ops.runtime.admission import admit_episode as admit
    from mass_ops.stages.units import episode_request

    ctx = attach_cycle(config)
    stop = admit(ctx, episode, lambda: episode_request(ctx, episode))
    return None if stop is None else stop.as_dict()


def lease_episode_pod(config: CycleConfig, episode: Any, pod: str) -> dict[str, Any] | None:
    """As an episode pod is created: lease its unit's next attempt on `pod`, so `status` counts it in flight until
    the pod's publisher records it (see `ops.leases`); None when the unit is final or the store refused the write."""
    from mass_ops.ops.leases import lease_episode_pod as lease

    return lease(config, episode, pod)


def end_episode_pod_lease(config: CycleConfig, episode: Any) -> bool:
    """An episode pod is gone without its publisher ending its lease (failed, never started, deleted on a kill): end
    it, so `status` stops counting the unit in flight (see `ops.leases`)."""
    from mass_ops.ops.leases import end_episode_pod_lease as end

    return end(config, episode)


def next_cycle_overrides(config: CycleConfig) -> dict[str, Any]:
    """The config keys of the cycle after `config` (L(k+1) as parent, models one generation on, seeds one stride);
    see `ops.plan.next_cycle_overrides`."""
    from mass_ops.ops.plan import next_cycle_overrides as following

    return following(config)


def status(config: CycleConfig, cycle: str | None = None) -> dict[str, Any]:
    """Where `cycle` (default: the config's) stands, read from the metadata store only: per stage units planned /
    done / failed / budget-stopped / pending, tokens and cost, budgets against the ledger, elapsed and ETA (see
    `ops.status`)."""
    from mass_ops.ops.status import cycle_status

    return cycle_status(config, cycle or config.cycle_name).as_dict()


# The function of every stage of `stages.registry`, by reference; tests/stages/test_registry.py fails for a stage
# without one here. It lives here, not in `stages.api`, because validation runs the plan's budget gate.
STAGE_FUNCTIONS: dict[registry.Stage, Callable[..., Any]] = {
    registry.VALIDATE: validate_config,
    registry.INFERENCE_UP: stages.inference_up,
    registry.SEARCH: stages.search,
    registry.COLLECT: stages.collect,
    registry.RANK: stages.rank,
    registry.SELECT: stages.select,
    registry.INFERENCE_DOWN: stages.inference_down,
    registry.RENDER: stages.render,
    registry.TRAIN: stages.train,
    registry.SELECT_CHECKPOINT: stages.select_checkpoint,
    registry.EXPORT: stages.export,
    registry.REGISTER: stages.register,
    registry.ROLLOUT: stages.evaluate,  # runs the missing rollouts, then judges
    registry.EVALUATE: stages.evaluate,
    registry.REPORT: stages.report,
    registry.PROMOTE: stages.promote,
    registry.NIGHTLY_EVALUATE: stages.nightly_evaluate,
    registry.CHECK_REGRESSION: stages.check_regression,
    registry.NIGHTLY_BENCHMARK: stages.nightly_benchmark_trial,
    registry.NIGHTLY_REPORT: stages.nightly_report,
    registry.BENCHMARK: stages.benchmark_trial,
}
