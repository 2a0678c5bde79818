"""`mass-ops repair`: the missing or failed units per stage, the exact commands that redo them (Airflow clear as REST
and CLI, mass-ops stage commands), a real redo of only those units, and "nothing to repair" afterwards."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from mass_ops.cli import app
from mass_ops.ops import repair
from mass_ops.ops.repair import RepairError, plan_repair, run_repair
from mass_ops.stages.collect import run_collect
from tests.inner_loop_fakes import FakeExecutor, InnerLoopEnv, inner_loop_fixture  # noqa: F401
from tests.ops.test_status import TASK, collected_with_one_failure, config_file

runner = CliRunner()


def test_dry_run_lists_the_failed_unit_and_the_exact_commands(inner_loop: InnerLoopEnv, tmp_path: Path) -> None:
    opened = collected_with_one_failure(inner_loop)
    cycle, source = opened.ctx.cycle_name, config_file(opened, tmp_path)
    before = len(opened.ctx.repo.episodes(opened.ctx.cycle_id))
    result = runner.invoke(app, ["repair", cycle, "--config", source, "--dry-run", "--dag-run-id", "manual__1"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert f"  collection-t{TASK}-c1  failed (attempt 2 infra_failure)" in lines
    assert lines[0] == f"cycle {cycle}: 1 unit(s) to redo"
    body = {
        "dag_run_id": "manual__1",
        "task_ids": ["inner_loop.collect_task"],
        "only_failed": True,
        "include_downstream": True,
        "dry_run": False,
    }
    rest = lines.index("  POST /api/v2/dags/mass_cycle/clearTaskInstances")
    assert json.loads("\n".join(lines[rest + 1 : lines.index("Airflow (CLI):")])) == body
    commands = unfolded(lines)
    clear = r"airflow tasks clear mass_cycle -t '^(inner_loop\.collect_task)$' --only-failed --downstream --yes"
    assert f"  {clear}" in commands
    assert f"  mass-ops collect --config {shlex.quote(source)} --tasks {TASK}" in commands
    assert "not started yet (the rest of the run, not a repair): rank, select" in " ".join(lines)
    assert len(opened.ctx.repo.episodes(opened.ctx.cycle_id)) == before  # a dry run changes nothing

    as_json = runner.invoke(app, ["repair", cycle, "--config", source, "--dry-run", "--json"])
    plan = json.loads(as_json.stdout)
    (stage,) = plan["stages"]
    assert stage["stage"] == "collect" and stage["tasks"] == [TASK]
    assert stage["units"] == [{"key": f"collection-t{TASK}-c1", "state": "failed", "detail": "attempt 2 infra_failure"}]
    assert plan["airflow_rest"]["body"]["dag_run_id"] == "<dag_run_id>"


def test_repair_redoes_only_the_failed_unit_then_finds_nothing(
    inner_loop: InnerLoopEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened = collected_with_one_failure(inner_loop)
    cycle, source = opened.ctx.cycle_name, config_file(opened, tmp_path)
    healthy = FakeExecutor(opened.ctx)  # the infrastructure works again
    calls: list[Any] = []

    def collect(config: Any, tasks: list[int] | None) -> Any:
        calls.append(tasks)
        return run_collect(config, tasks, executor=healthy)

    monkeypatch.setattr(repair, "default_runners", lambda: {"collect": collect})
    result = runner.invoke(app, ["repair", cycle, "--config", source])
    assert result.exit_code == 0, result.output
    assert "repaired collect: 1 unit(s) redone" in result.stdout
    assert calls == [[TASK]]
    assert [key.split("/", 1)[1] for key in healthy.executed] == [f"collection-t{TASK}-c1-s{key_seed(opened)}/a3"]
    statuses = [e.status for e in opened.ctx.repo.episodes(opened.ctx.cycle_id, kind="collection")]
    assert statuses.count("succeeded") == 3 and len(statuses) == 5  # 2 first-run + 2 failed attempts + the redo

    again = runner.invoke(app, ["repair", cycle, "--config", source, "--dry-run"])
    assert again.exit_code == 0, again.output
    assert again.stdout.splitlines()[0].startswith(f"cycle {cycle}: nothing to repair (not started yet: rank")
    assert calls == [[TASK]]


def unfolded(lines: list[str]) -> list[str]:
    """The lines with every folded command joined back into one line (what a shell reads)."""
    out: list[str] = []
    for line in lines:
        if out and out[-1].endswith(" \\"):
            out[-1] = out[-1][:-2] + " " + line.strip()
        else:
            out.append(line)
    return out


def key_seed(opened: Any) -> int:
    from mass_ops.seeds import collection_seed

    return collection_seed(opened.config.collection.seed_base, TASK, 1)


def test_running_a_repair_needs_the_cycles_own_config(inner_loop: InnerLoopEnv) -> None:
    opened = collected_with_one_failure(inner_loop)
    plan = plan_repair(opened.config, opened.ctx.cycle_name)
    other = opened.config.model_copy(update={"name": "another-cycle"})
    with pytest.raises(RepairError, match="the config names cycle 'another-cycle'"):
        run_repair(other, plan)


def test_an_episode_at_work_under_its_lease_is_listed_in_flight_and_not_redone(inner_loop: InnerLoopEnv) -> None:
    """c1 failed twice on infrastructure and its third attempt is running now (a fresh lease): repairing must not
    start it a second time beside the running one."""
    from datetime import UTC, datetime, timedelta

    from mass_ops.seeds import collection_seed

    opened = collected_with_one_failure(inner_loop)
    ctx = opened.ctx
    seed = collection_seed(ctx.config.collection.seed_base, TASK, 1)
    ctx.repo.start_episode_lease(ctx.cycle_id, task_id=TASK, kind="collection", candidate=1, seed=seed, attempt=3,
                                 started_at=datetime.now(UTC) - timedelta(minutes=2), host="node-b pid 9")  # fmt: skip
    plan = plan_repair(opened.config, ctx.cycle_name)
    assert plan.nothing_to_repair and [u.key for u in plan.in_flight] == [f"collection-t{TASK}-c1"]
    lines = plan.lines([])
    assert lines[0].startswith(f"cycle {ctx.cycle_name}: nothing to repair")
    text = " ".join(line.strip() for line in lines)
    assert (
        f"in flight now, not redone: collect collection-t{TASK}-c1 (attempt 3 started 2m ago on node-b pid 9)" in text
    )
    assert all(len(line) <= 80 for line in lines)
    assert plan.as_dict([])["in_flight"] == [
        {"stage": "collect", "key": f"collection-t{TASK}-c1", "detail": "attempt 3 started 2m ago on node-b pid 9"}
    ]
