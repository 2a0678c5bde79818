"""Structure of the nightly evaluation DAG: cron, no catchup, servers as setup/teardown, regression gate last."""

from __future__ import annotations

import pytest
from airflow.sdk import TriggerRule
from mass_ops_airflow.params import NIGHTLY_KNOBS
from mass_ops_airflow.pools import GPU_POOL, INFERENCE_POOL

from tests.dags.dag_files import dag_module


@pytest.fixture(scope="module")
def dag():
    return dag_module("mass_nightly_eval").dag


def test_schedule_and_catchup(dag):
    assert dag.schedule == "0 3 * * *" and dag.timetable.expression == "0 3 * * *"
    assert dag.catchup is False and dag.max_active_runs == 1
    assert set(dag.params) == {"preset", "overrides", *NIGHTLY_KNOBS}


def test_graph(dag):
    up, down = dag.get_task("nightly_inference_up"), dag.get_task("nightly_inference_down")
    assert up.is_setup and down.is_teardown and down.trigger_rule == TriggerRule.ALL_DONE_SETUP_SUCCESS
    assert up.pool == GPU_POOL and up.scope == "nightly"
    evaluate = dag.get_task("nightly_evaluate")
    assert evaluate.pool == INFERENCE_POOL and evaluate.map_index_template == "{{ unit_label }}"
    assert "nightly_inference_up" in evaluate.upstream_task_ids
    assert {"nightly_targets", "nightly_inference_up"} <= set(evaluate.get_flat_relative_ids(upstream=True))
    assert "nightly_evaluate" in down.upstream_task_ids
    gate = dag.get_task("check_regression")
    assert gate.upstream_task_ids == {"nightly_evaluate"} and gate.retries == 0
    assert "serving_targets" in up.upstream_task_ids


def test_the_report_runs_beside_the_regression_gate(dag):
    report = dag.get_task("nightly_report")
    assert type(report).__name__ == "ReportOperator" and report.stage == "nightly_report"
    assert [link.name for link in report.operator_extra_links] == ["Cycle report"]
    # Not downstream of the gate: a regression fails the run and the report is still written.
    assert report.upstream_task_ids == {"nightly_evaluate"}
    assert "check_regression" not in report.get_flat_relative_ids(upstream=True)
    # Written when an evaluation failed too; skipped only when there was nothing to evaluate.
    assert report.trigger_rule == TriggerRule.NONE_SKIPPED
