"""The DAGs' tasks call the stage functions by name with the run's config and the mapped arguments.

Each task's callable is invoked directly with a stand-in `mass_ops.stages.api` that records its calls (the real
end-to-end run is `dag.test()` once every stage exists); the config each stage receives is rebuilt from the params.
"""

from __future__ import annotations

import datetime as dt
from copy import copy
from typing import Any
from unittest import mock

import pytest
from airflow.sdk.exceptions import AirflowSkipException, DagRunTriggerException
from airflow.sdk.execution_time.context import set_current_context

from tests.dags.dag_files import dag_module

DEMO = {"preset": "demo", "generation": 2, "served_name": "L2", "parent_model": "models/L2-bf16",
        "overrides": ["models.next_bf16=models/L3-bf16", "models.next_fp8=models/L3-fp8"]}  # fmt: skip


class OutletEvents:
    """Collects `outlet_events[alias].add(asset, extra=...)` calls."""

    def __init__(self) -> None:
        self.added: list[tuple[Any, Any, dict]] = []

    def __getitem__(self, alias: Any) -> Any:
        events = self

        class Accessor:
            def add(self, asset: Any, extra: dict | None = None) -> None:
                events.added.append((alias, asset, extra or {}))

        return Accessor()


def call(dag, task_id: str, context: dict | None = None, **kwargs: Any) -> Any:
    function = dag.get_task(task_id).python_callable
    with set_current_context(context if context is not None else {}):
        return function(**kwargs)


@pytest.fixture(scope="module")
def cycle_dag():
    return dag_module("mass_cycle").dag


@pytest.fixture(scope="module")
def nightly_dag():
    return dag_module("mass_nightly_eval").dag


def test_every_in_process_task_calls_its_stage(cycle_dag, stages):
    stages.results.update(
        {
            "search_tasks": [51, 202],
            "rollout_units": [["L2", 51, 0], ["L3", 60, 1]],
        }
    )
    assert call(cycle_dag, "validate_config", params=DEMO) == {"stage": "validate_config"}
    assert call(cycle_dag, "search_tasks", params=DEMO) == [51, 202]
    context: dict[str, Any] = {}
    call(cycle_dag, "inner_loop.step_v0", context, task_no=51, params=DEMO)
    assert context["unit_label"] == "search-t51-v0"
    collect = copy(cycle_dag.get_task("inner_loop.collect_task"))
    collect.task = 202  # what the mapped group renders into the instance for its task
    collection: dict[str, Any] = {"params": DEMO}
    assert collect.execute(collection) == {"backend": "local", "task": 202, "result": {"stage": "collect_task"}}
    assert collection["unit_label"] == "collection-t202 (3 candidates)"
    call(cycle_dag, "inner_loop.rank_task", context, task_no=202, params=DEMO)
    assert context["unit_label"] == "ranking-t202"
    for task_id in ("select", "render", "select_checkpoint", "evaluate"):
        call(cycle_dag, task_id, params=DEMO)
    # The report step is an operator (it carries the report link); it returns the stage's result and the cycle.
    assert cycle_dag.get_task("report").execute({"params": DEMO}) == {"stage": "report", "cycle": "demo-L2"}
    assert call(cycle_dag, "rollout_units", params=DEMO) == [
        {"generation": "L2", "task": 51, "replicate": 0}, {"generation": "L3", "task": 60, "replicate": 1},
    ]  # fmt: skip

    assert [(name, args[1:]) for name, args in stages.calls] == [
        ("validate_config", ()),
        ("search_tasks", ()),
        ("search_step", (51, 0)),
        ("collect_task", (202,)),
        ("rank_task", (202,)),
        ("select", ()),
        ("render", ()),
        ("select_checkpoint", ()),
        ("evaluate", ()),
        ("report", ()),
        ("rollout_units", ()),
    ]
    hashes = {args[0].config_hash() for _, args in stages.calls}
    assert len(hashes) == 1, "every task rebuilds the same config from the same params"
    config = stages.calls[0][1][0]
    assert (config.cycle_name, config.generation, config.models.served_name) == ("demo-L2", 2, "L2")


def test_mapped_operator_arguments_match_the_units(cycle_dag):
    """rollout_units returns exactly the keyword arguments the mapped rollout operator takes."""
    from mass_ops_airflow.operators import EpisodeStageOperator

    unit = {"generation": "L1", "task": 60, "replicate": 2}
    partial = dict(cycle_dag.get_task("rollout").partial_kwargs)
    operator = EpisodeStageOperator(task_id="probe", **{k: partial[k] for k in ("kind", "stage")}, **unit)
    assert operator.episode().task_id == unit["task"]
    assert operator.stage_arguments(operator.episode())[-1] == unit["replicate"]


def test_a_task_searched_only_or_not_collected_skips_its_collection(cycle_dag, stages):
    collect = copy(cycle_dag.get_task("inner_loop.collect_task"))
    collect.task = 60  # a test task: never trained
    with pytest.raises(AirflowSkipException, match=r"task 60 is searched only \(not in tasks\.train\)"):
        collect.execute({"params": DEMO})
    assert stages.calls == [], "no stage runs for it"
    reason = "no workflow version beat the reference; task skipped (collection.require_beats_reference)"
    stages.results["collect_task"] = {"task_id": 51, "decision": "skip", "reason": reason}
    collect.task = 51
    with pytest.raises(AirflowSkipException, match=r"task 51: no workflow version beat the reference"):
        collect.execute({"params": DEMO})
    assert stages.names() == ["collect_task"]


def test_promote_emits_the_generation_asset_event(cycle_dag, stages):
    stages.results["promote"] = {"generation": "L3", "generation_id": 7, "fp8_uri": "s3://b/models/L3-fp8"}
    events = OutletEvents()
    ti = mock.MagicMock()
    ti.xcom_pull.return_value = {"chosen_options": ["Approve"], "responded_by_user": {"id": "1", "name": "ops-lead"}}
    result = call(cycle_dag, "promote", {"outlet_events": events, "ti": ti}, params=DEMO)
    assert result["generation"] == "L3"
    assert stages.calls[-1][1][1:] == ("ops-lead",), "who approved goes to the promotion record"
    ((alias, asset, extra),) = events.added
    assert alias.name == "mass-ops-generations" and asset.uri == "mass-ops://generations/L3"
    assert extra == {"generation": "L3", "generation_id": 7, "fp8_uri": "s3://b/models/L3-fp8"}


def test_auto_continue_triggers_the_next_cycle_once(cycle_dag, stages):
    with pytest.raises(AirflowSkipException, match="auto_continue is off"):
        call(cycle_dag, "continue_cycle", params=DEMO)
    with pytest.raises(DagRunTriggerException) as caught:
        call(cycle_dag, "continue_cycle", params={**DEMO, "auto_continue": True})
    trigger = caught.value
    assert trigger.trigger_dag_id == "mass_cycle" and trigger.dag_run_id == "auto__demo-L3"
    assert trigger.skip_when_already_exists is True
    assert (trigger.conf["generation"], trigger.conf["served_name"], trigger.conf["parent_model"]) == (
        3, "L3", "models/L3-bf16",
    )  # fmt: skip
    assert 'models.next_fp8="models/L4-fp8"' in trigger.conf["overrides"]


def test_nightly_keys_evaluations_by_logical_date(nightly_dag, stages):
    params = {"preset": "demo"}
    stages.results.update({"nightly_targets": ["L1", "L2"], "check_regression": {"regressions": []}})
    assert call(nightly_dag, "nightly_targets", params=params) == ["L1", "L2"]
    when = dt.datetime(2026, 3, 4, 3, 0, tzinfo=dt.UTC)
    context: dict[str, Any] = {"logical_date": when}
    call(nightly_dag, "nightly_evaluate", context, generation="L2", params=params)
    assert context["unit_label"] == "L2"
    assert stages.calls[-1][0] == "nightly_evaluate" and stages.calls[-1][1][1:] == ("L2", when.isoformat())
    assert call(nightly_dag, "check_regression", results=[{"g": "L2"}], params=params) == {"regressions": []}
    assert stages.calls[-1][1][1:] == ([{"g": "L2"}],)
    assert call(nightly_dag, "serving_targets", generations=["L2"], params=params) == []  # local: the stage serves


def test_nightly_regression_fails_the_run(nightly_dag, stages):
    stages.results["check_regression"] = {"regressions": [{"generation": "L2", "drop": 0.12}]}
    with pytest.raises(RuntimeError, match=r"regression beyond evaluation\.regression_threshold"):
        call(nightly_dag, "check_regression", results=[], params={"preset": "demo"})
