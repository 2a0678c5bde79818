"""Rollouts: bare-task episodes of a generation over the task pool, seeds as in MASS_SPEC §1/§10, recorded as kind
"rollout" with the generation set; sets are never overwritten."""

from __future__ import annotations

from collections import Counter

import pytest

from mass_ops.evaluation.rollouts import (
    RolloutError,
    load_rollout_set,
    resolve_rollout_tasks,
    rollout_manifest_key,
    rollout_requests,
    rollout_sets,
    run_rollouts,
)
from mass_ops.layout import EpisodeUnit, bare_condition
from mass_ops.seeds import rollout_seed
from mass_ops.store.schema import episode_unit_key
from tests.inner_loop_fakes import FailurePlan


def test_generation_unit_puts_the_generation_in_slug_key_and_artifacts():
    plain = EpisodeUnit("c", 51, "rollout", 915100, candidate=0)
    unit = EpisodeUnit("c", 51, "rollout", 915100, candidate=0, generation="L1")
    assert unit.slug == f"{plain.slug}-gL1"
    assert unit.key == "c/rollout-t51-c0-s915100-gL1/a1"
    assert unit.artifact_key("workspace") == "cycles/c/episodes/rollout-t51-c0-s915100-gL1/a1/workspace.tar.gz"
    # The unit's key matches the metadata row's key format.
    row_key = episode_unit_key(task_id="51", kind="rollout", seed=915100, attempt=1, candidate=0, generation="L1")
    assert unit.key == f"c/{row_key}"


def test_requests_use_the_reference_seeds_bare_prompts_and_the_default_pool(eval_env):
    ctx = eval_env.ctx
    requests = rollout_requests(ctx, "L1", count=2)
    pool = eval_env.config.rollout_tasks()
    assert pool == [51, 60]  # evaluation.tasks of the test config
    assert [(r.unit.task_id, r.unit.candidate) for r in requests] == [(51, 0), (51, 1), (60, 0), (60, 1)]
    for request in requests:
        task, replicate = request.unit.task_id, request.unit.candidate
        assert request.unit.seed == rollout_seed(910000, task, replicate) == 910000 + 100 * task + replicate
        assert request.unit.kind == "rollout" and request.generation == "L1"
        assert request.condition == bare_condition(task) == f"t{task}_bare"
        assert request.prompt == ctx.catalogue.task(task).bare_prompt


def test_task_pool_options(eval_env):
    config = eval_env.config
    assert resolve_rollout_tasks(config) == config.rollout_tasks()
    assert resolve_rollout_tasks(config, split="test") == [60]
    assert resolve_rollout_tasks(config, split="train") == [51, 202]
    assert resolve_rollout_tasks(config, split="all") == [51, 202, 60]
    assert resolve_rollout_tasks(config, tasks=[202]) == [202]
    with pytest.raises(RolloutError, match=r"tasks \[999\] are neither"):
        resolve_rollout_tasks(config, tasks=[999])
    with pytest.raises(RolloutError, match="not both"):
        resolve_rollout_tasks(config, tasks=[51], split="test")
    with pytest.raises(RolloutError, match="more than once"):
        resolve_rollout_tasks(config, tasks=[51, 51])
    with pytest.raises(RolloutError, match="count must be"):
        rollout_requests(eval_env.ctx, "L1", count=0)


def test_rollouts_of_two_generations_are_recorded_apart(eval_env):
    ctx = eval_env.ctx
    executor = eval_env.rollout_executor()
    new = run_rollouts(ctx, executor, "L1", count=2)
    old = run_rollouts(ctx, executor, "L0", count=2)
    episodes = ctx.repo.episodes(ctx.cycle_id, kind="rollout")
    assert Counter(e.generation for e in episodes) == {"L1": 4, "L0": 4}
    assert all(e.condition == f"t{e.task_id}_bare" and e.candidate is not None for e in episodes)
    # Same seeds for both generations (paired), different units and artifacts.
    assert sorted(e.seed for e in episodes if e.generation == "L1") == sorted(
        e.seed for e in episodes if e.generation == "L0"
    )
    workspaces = [e.artifacts["workspace"] for e in episodes]
    assert len(set(workspaces)) == 8
    assert [(x.task, x.replicate) for x in new.entries] == [(51, 0), (51, 1), (60, 0), (60, 1)]
    assert {x.workspace for x in new.entries}.isdisjoint({x.workspace for x in old.entries})
    # The set is an evaluation row and a manifest artifact.
    assert [s.label for s in rollout_sets(ctx)] == [new.label, old.label]
    assert load_rollout_set(ctx, new.label) == new
    assert ctx.artifacts.get_json(rollout_manifest_key(ctx.cycle_name, new.label)) == new.as_results()


def test_a_set_is_never_overwritten(eval_env):
    ctx = eval_env.ctx
    executor = eval_env.rollout_executor()
    first = run_rollouts(ctx, executor, "L1", count=1, label="nightly-1")
    executed = list(executor.executed)
    # Rerunning the same set reuses it and runs nothing.
    assert run_rollouts(ctx, executor, "L1", count=1, label="nightly-1") == first
    assert executor.executed == executed
    # Another pool or count under the same label is refused.
    with pytest.raises(RolloutError, match=r"already exists.*choose a new label"):
        run_rollouts(ctx, executor, "L1", count=2, label="nightly-1")
    with pytest.raises(RolloutError, match="already exists"):
        run_rollouts(ctx, executor, "L0", count=1, label="nightly-1")
    # A new label is a new set; finished episodes are reused, only the new replicate runs.
    second = run_rollouts(ctx, executor, "L1", count=2, label="nightly-2")
    assert len(executor.executed) == len(executed) + 2
    assert load_rollout_set(ctx, "nightly-1") == first
    assert {e.episode_id for e in first.entries} < {e.episode_id for e in second.entries}
    # The default label depends on pool and count only: the same request resumes the same set.
    assert run_rollouts(ctx, executor, "L1", count=2).label == run_rollouts(ctx, executor, "L1", count=2).label
    with pytest.raises(RolloutError, match="is not recorded"):
        load_rollout_set(ctx, "nightly-9")


def test_unregistered_generation_and_infrastructure_failures(eval_env):
    ctx = eval_env.ctx
    with pytest.raises(RolloutError, match="'L7' is not a registered model"):
        run_rollouts(ctx, eval_env.rollout_executor(), "L7", count=1)
    with pytest.raises(RolloutError, match="generation must be"):
        rollout_requests(ctx, "L1/x", count=1)
    slug = EpisodeUnit(ctx.cycle_name, 60, "rollout", rollout_seed(910000, 60, 0), candidate=0, generation="L1").slug
    failing = eval_env.rollout_executor(failures={slug: FailurePlan(infra_attempts=5)}, max_attempts=2)
    with pytest.raises(RolloutError, match="1 episode\\(s\\) ended in infrastructure failures"):
        run_rollouts(ctx, failing, "L1", count=1, label="flaky")
    assert rollout_sets(ctx) == []  # nothing recorded
    # Once the endpoint is healthy the rerun makes a new attempt for the failed unit only.
    healthy = eval_env.rollout_executor()
    done = run_rollouts(ctx, healthy, "L1", count=1, label="flaky")
    assert [e.unit_key.rsplit("/", 1)[1] for e in done.entries] == ["a1", "a3"]
    assert len(healthy.executed) == 1


def test_a_budget_stopped_rollout_is_not_frozen_into_the_set(eval_env):
    ctx = eval_env.ctx
    slug = EpisodeUnit(ctx.cycle_name, 60, "rollout", rollout_seed(910000, 60, 0), candidate=0, generation="L1").slug
    stopped = eval_env.rollout_executor(failures={slug: FailurePlan(budget_exhausted=True)})
    with pytest.raises(RolloutError, match=r"1 episode\(s\) were stopped by a spent budget .*raise the budget"):
        run_rollouts(ctx, stopped, "L1", count=1, label="capped")
    assert rollout_sets(ctx) == []  # nothing recorded: a raised budget redoes the stopped unit
