"""The report's stages against the stage registry: its stage rows are the registry's cost categories, in its order,
and every episode and model call lands in the row of the stage that records it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from mass_ops.evaluation.report import JUDGING_STAGES, STAGE_ORDER, collect_report_data
from mass_ops.evaluation.report.model import TRAIN_STAGE, call_stage, episode_stage
from mass_ops.stage_registry import COST_CATEGORIES, STAGES
from mass_ops.store.schema import CallPurpose, EpisodeKind
from tests.evaluation.test_report import report_cycle

T0 = datetime(2026, 10, 1, 8, 0, tzinfo=UTC)


def test_the_report_s_stage_list_is_the_registry_s_cost_categories():
    assert STAGE_ORDER == COST_CATEGORIES
    assert TRAIN_STAGE in STAGE_ORDER
    assert {label.split(":")[0] for label in JUDGING_STAGES.values()} <= set(STAGE_ORDER)


def test_every_unit_a_stage_records_is_reported_under_that_stage_s_cost_category():
    for stage in STAGES:
        if stage.cost_category is None:
            continue
        for kind in stage.episode_kinds:
            assert episode_stage(kind) == stage.cost_category, (stage.name, kind)
        for purpose in stage.call_purposes:
            assert call_stage("task1/x/a1", purpose) == stage.cost_category, (stage.name, purpose)
        if stage.call_prefix:
            assert {call_stage(f"{stage.call_prefix}x/a1", p) for p in CallPurpose} == {stage.cost_category}
    assert {episode_stage(kind) for kind in EpisodeKind} <= set(STAGE_ORDER)
    assert {call_stage("task1/x/a1", purpose) for purpose in CallPurpose} <= set(STAGE_ORDER)


def test_a_cycle_with_every_kind_of_unit_reports_every_cost_category_in_the_registry_s_order(eval_env):
    ctx = report_cycle(eval_env)
    repo, cycle = ctx.repo, ctx.cycle_id
    for i, kind in enumerate(EpisodeKind):
        repo.record_episode(cycle, task_id=51, kind=kind, seed=900_000 + i, status="succeeded", completion_tokens=10,
                            generation="L1" if kind in ("rollout", "benchmark") else None,
                            started_at=T0, finished_at=T0 + timedelta(minutes=5))  # fmt: skip
    for purpose in CallPurpose:
        key = f"eval/external/{purpose}/a1" if purpose == CallPurpose.EXTERNAL_JUDGE else f"task51/{purpose}/a1"
        repo.record_llm_call(cycle, key, purpose=purpose, model="m", task_id=51, prompt_tokens=5, completion_tokens=1)
    run = repo.ensure_training_run(cycle, "sft", {"steps": 1})
    repo.set_training_run_status(run.id, "running")
    repo.set_training_run_status(run.id, "succeeded")

    data = collect_report_data(ctx)

    assert tuple(s.stage for s in data.stages) == COST_CATEGORIES
    rows = {s.stage: s for s in data.stages}
    assert rows["search"].episodes == 2 and rows["search"].calls == 3  # reference + search; judge, optimizer, arbiter
    assert rows["rank"].calls == 1 and rows["evaluate"].calls == 1 and rows["evaluate"].episodes == 1
    assert rows["benchmark"].episodes == 1 and rows["collect"].episodes == 1
