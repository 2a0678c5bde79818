"""The stage layer as the DAG uses it: one call per unit (search step, collection candidate, ranked task), with the
inner-loop fakes standing in for qwen-code episodes and the scripted policy server for the model."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
from typer.testing import CliRunner

from mass_ops.cli import app
from mass_ops.context import attach_cycle
from mass_ops.ops import api as ops
from mass_ops.stages import api as stages
from tests.inner_loop_fakes import FakeExecutor, inner_loop_fixture  # noqa: F401  (fixture)


@pytest.fixture
def fake_episodes(monkeypatch):
    """Route the stages' executor to the fake one (real rows and artifacts, scripted workspaces)."""

    @contextmanager
    def executor(ctx):
        yield FakeExecutor(ctx)

    monkeypatch.setattr(stages, "episode_executor", executor)


def test_stage_units_run_a_cycle_through_selection_and_rerun_as_no_ops(inner_loop, fake_episodes):
    config = inner_loop.config(iterations=1, candidates=3, train_ranks=1, opponents=2, require_beats_reference=False)
    opened = ops.validate_config(config)
    assert opened["cycle"] == config.cycle_name

    for task_id in stages.search_tasks(config):
        for version in range(config.search.iterations + 2):  # one step past the budget is a no-op
            row = stages.search_step(config, task_id, version)
            assert row["task_id"] == task_id
    ctx = attach_cycle(config)
    assert {r.task_id for r in ctx.repo.retained_workflows(ctx.cycle_id)} == {"51", "202"}

    units = stages.collection_units(config)
    assert sorted(units) == [[51, 0], [51, 1], [51, 2], [202, 0], [202, 1], [202, 2]]
    for task_id, candidate in units:
        row = stages.collect_candidate(config, task_id, candidate)
        assert row["status"] == "succeeded"

    ranked = [stages.rank_task(config, task_id) for task_id in stages.ranking_tasks(config)]
    assert len(ranked) == 2
    selected = stages.select(config)
    assert sum(row["train"] for row in selected["tasks"]) == 2
    assert sum(row["val"] for row in selected["tasks"]) == 2

    episodes = len(ctx.repo.episodes(ctx.cycle_id))
    comparisons = sum(len(ctx.repo.comparisons(ctx.cycle_id, ledger)) for ledger in ("rhi", "champion", "ranking"))
    # A cleared and rerun DAG repeats nothing.
    for task_id in stages.search_tasks(config):
        stages.search_step(config, task_id, config.search.iterations)
    for task_id, candidate in units:
        stages.collect_candidate(config, task_id, candidate)
    for task_id in stages.ranking_tasks(config):
        stages.rank_task(config, task_id)
    assert len(ctx.repo.episodes(ctx.cycle_id)) == episodes
    assert sum(len(ctx.repo.comparisons(ctx.cycle_id, ledger)) for ledger in ("rhi", "champion", "ranking")) == (
        comparisons
    )
    json.dumps(selected)  # XCom-safe
    calls = ctx.repo.llm_calls(ctx.cycle_id)
    assert calls and all(
        call.prompt_sha256 == ctx.artifacts.info(ctx.artifacts.key_of(call.prompt_uri)).sha256
        and call.result_sha256 == ctx.artifacts.info(ctx.artifacts.key_of(call.result_uri)).sha256
        for call in calls
    )

    report = stages.report(config)
    html = ctx.artifacts.get_bytes(ctx.artifacts.key_of(report["html"])).decode()
    assert "RHI" in html and report["figures"] > 0


def test_cli_runs_the_inner_loop_and_refuses_a_changed_config(inner_loop, fake_episodes, tmp_path):
    config = inner_loop.config(iterations=1, candidates=3, train_ranks=1, opponents=2, require_beats_reference=False)
    path = tmp_path / "cycle.json"
    path.write_text(json.dumps(config.model_dump(mode="json")))
    runner = CliRunner()
    for command in ("validate", "search", "collect", "rank", "select"):
        result = runner.invoke(app, [command, "--config", str(path)])
        assert result.exit_code == 0, (command, result.output)
    assert "selection" in result.output

    result = runner.invoke(app, ["search", "--config", str(path), "--set", "search.iterations=2"])
    assert result.exit_code == 2
    assert "frozen with config hash" in result.stderr


def test_collect_task_runs_one_tasks_candidates_as_one_unit_and_reruns_as_a_no_op(inner_loop, fake_episodes):
    """The per-task collection unit of the pipelined DAG: every candidate of that task, none of another's."""
    config = inner_loop.config(iterations=1, candidates=3, train_ranks=1, opponents=2, require_beats_reference=False)
    ops.validate_config(config)
    for task_id in stages.search_tasks(config):
        for version in range(config.search.iterations + 1):
            stages.search_step(config, task_id, version)
    ctx = attach_cycle(config)

    row = stages.collect_task(config, 51)
    assert (row["task_id"], row["candidates"], row["succeeded"], row["infra_failures"]) == (51, 3, 3, 0)
    collected = {(e.task_id, e.candidate) for e in ctx.repo.episodes(ctx.cycle_id) if e.kind == "collection"}
    assert collected == {("51", 0), ("51", 1), ("51", 2)}, "only task 51's candidates ran"

    episodes = len(ctx.repo.episodes(ctx.cycle_id))
    assert stages.collect_task(config, 51)["succeeded"] == 3
    assert len(ctx.repo.episodes(ctx.cycle_id)) == episodes, "a rerun reuses the finished candidates"
