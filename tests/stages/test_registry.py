"""The stage registry against what it describes: every DAG task, the API's functions, the CLI's commands."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

import tests.plugins.airflow_env as airflow_env  # before Airflow: its home and DAG folder
from mass_ops.ops import api as ops
from mass_ops.stages import api, registry
from mass_ops.stages.registry import NON_STAGE_TASKS, PLANNED, STAGES, TRACKED, stage_of_task
from mass_ops.store.schema import CallPurpose, EpisodeKind


def unmapped(tasks: Mapping[str, Iterable[str]]) -> list[str]:
    """`dag.task` of every task that is neither a stage's nor listed as a non-stage task."""
    return [
        f"{dag}.{task}"
        for dag, ids in tasks.items()
        for task in ids
        if stage_of_task(dag, task) is None and task not in NON_STAGE_TASKS.get(dag, ())
    ]


@pytest.fixture(scope="module")
def dag_tasks() -> dict[str, list[str]]:
    """Task ids (group-qualified) of every DAG in dags/, loaded by Airflow's DagBag."""
    from airflow.dag_processing.dagbag import DagBag

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MASS_NIGHTLY_DEADLINE_HOURS", "0")  # as tests/dags: no deadline object to build
        bag = DagBag(dag_folder=str(airflow_env.DAGS_FOLDER))
    assert bag.import_errors == {}
    return {dag.dag_id: sorted(dag.task_dict) for dag in bag.dags.values()}


def test_every_task_of_every_dag_belongs_to_a_stage(dag_tasks):
    assert set(dag_tasks) == {registry.CYCLE_DAG, registry.NIGHTLY_DAG, registry.BENCHMARKS_DAG}
    assert unmapped(dag_tasks) == []


def test_a_dag_task_without_a_stage_is_reported():
    assert unmapped({registry.CYCLE_DAG: ["inner_loop.step_v4", "shiny_new_step"]}) == ["mass_cycle.shiny_new_step"]


def test_every_task_the_registry_names_exists_and_belongs_to_one_stage(dag_tasks):
    for stage in STAGES:
        for pattern in stage.dag_tasks:
            assert any(fnmatchcase(task, pattern) for task in dag_tasks[stage.dag]), f"{stage.name}: {pattern}"
    for stage in TRACKED:  # what `repair` clears (its search steps are listed per version: see test_repair)
        if stage is not registry.SEARCH:
            assert set(stage.repair_tasks) <= set(dag_tasks[stage.dag]), stage.name
    for dag, tasks in dag_tasks.items():
        for task in tasks:
            owners = [s.name for s in STAGES if s.dag == dag and s.owns_task(task)]
            assert len(owners) <= 1, f"{dag}.{task}: {owners}"
    for dag, tasks in NON_STAGE_TASKS.items():
        assert set(tasks) <= set(dag_tasks[dag])


def test_every_stage_has_its_function_in_the_stage_or_ops_api():
    assert set(ops.STAGE_FUNCTIONS) == set(STAGES)
    for stage, function in ops.STAGE_FUNCTIONS.items():
        module = ops if function.__module__ == ops.__name__ else api
        assert getattr(module, function.__name__) is function, stage.name


def test_every_declared_command_exists_in_the_cli():
    from typer.main import get_command

    from mass_ops.cli import app

    commands = get_command(app).commands  # type: ignore[attr-defined]
    declared = [stage.command for stage in STAGES if stage.command]
    assert declared and set(declared) <= set(commands)


def test_the_stage_command_runs_exactly_the_registry_s_jobs():
    from typer.testing import CliRunner

    from mass_ops.cli import app

    result = CliRunner().invoke(app, ["stage", "nonsense", "--config", "demo"])
    assert result.exit_code == 2
    jobs = [stage.name for stage in registry.JOBS]
    assert jobs == ["validate_config", "render", "train", "select_checkpoint", "export", "register", "report"]
    assert f"choose one of {', '.join(jobs)}" in result.stderr


def test_names_are_unique_and_unit_kinds_are_the_store_s():
    names = [stage.name for stage in STAGES]
    assert len(names) == len(set(names))
    assert len({s.command for s in STAGES if s.command}) == sum(1 for s in STAGES if s.command)
    for stage in STAGES:
        assert set(stage.episode_kinds) <= set(EpisodeKind), stage.name
        assert set(stage.call_purposes) <= set(CallPurpose), stage.name
    kinds = [kind for stage in TRACKED for kind in stage.episode_kinds]
    assert len(kinds) == len(set(kinds)), "an episode kind counts for one followed stage"


def test_plan_and_status_follow_the_registry_s_order():
    from mass_ops.config import load_config
    from mass_ops.ops.plan import build_plan

    config = load_config("demo", ())
    plan = build_plan(config, ["train"], lineage=False)
    assert [p.stage for p in plan.stages] == [s.name for s in PLANNED]
    assert [s.name for s in TRACKED] == [
        "search", "collect", "rank", "select", "render", "train", "export", "rollout", "evaluate",
    ]  # fmt: skip


def _dag_references(folder: Path) -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) for every stage function the DAG files reach: `api.X` / `ops.X` attributes after
    importing the API modules, and the string names given to operators (`stage=`, `local_stage=`, …)."""
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("api", "ops"):
                found.append((path.name, node.lineno, node.value.id, node.attr))
            elif (
                isinstance(node, ast.keyword)
                and (node.arg or "").endswith("stage")
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                found.append((path.name, node.lineno, "name", node.value.value))
    return found


def _missing(references: list[tuple[str, int, str, str]]) -> list[str]:
    from mass_ops_airflow.cycle import stage_function

    def resolves(module: str, name: str) -> bool:
        if module != "name":
            return callable(getattr({"api": api, "ops": ops}[module], name, None))
        try:
            return callable(stage_function(name))
        except AttributeError:
            return False

    return [f"{file}:{line} {module}.{name}" for file, line, module, name in references if not resolves(module, name)]


def test_every_stage_function_a_dag_names_exists():
    """A typo in a DAG's stage reference fails here, not in the middle of a run."""
    references = _dag_references(Path(__file__).resolve().parents[2] / "dags")
    assert len(references) >= 25, references  # the reader sees the DAGs' calls
    assert _missing(references) == []


def test_a_misspelt_stage_in_a_dag_is_caught(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text(
        "from mass_ops.stages import api\nrun_stage(api.serch_tasks, {})\nReportOperator(stage='reprot')\n"
    )
    assert _missing(_dag_references(tmp_path)) == ["bad.py:2 api.serch_tasks", "bad.py:3 name.reprot"]


def test_the_stage_layer_s_registry_is_the_floor_s():
    """`mass_ops.stages.registry` re-exports `mass_ops.stage_registry`: one set of declarations, two addresses."""
    from mass_ops import stage_registry

    assert registry.STAGES is stage_registry.STAGES and registry.SEARCH is stage_registry.SEARCH
    assert set(registry.__all__) >= {name for name in vars(stage_registry) if name.isupper()}


def test_cost_categories_of_stages_episodes_and_calls():
    from mass_ops.stage_registry import (
        COST_CATEGORIES,
        call_cost_category,
        cost_category,
        episode_cost_category,
    )

    assert COST_CATEGORIES == ("search", "collect", "rank", "train", "evaluate", "benchmark")
    assert cost_category(registry.ROLLOUT) == "evaluate"
    with pytest.raises(ValueError, match="select"):
        cost_category(registry.SELECT)
    assert [episode_cost_category(kind) for kind in ("reference", "collection", "rollout", "benchmark", "x")] == [
        "search",
        "collect",
        "evaluate",
        "benchmark",
        None,
    ]
    assert call_cost_category("task51/ranking/m1/a1", "self_judge") == "rank"
    assert call_cost_category("eval/self/x/a1", "self_judge") == "evaluate"  # the evaluation's own judge
    assert call_cost_category("task51/rhi/v1/a1", "optimizer") == "search"
    assert call_cost_category("task51/x/a1", "unknown") is None
