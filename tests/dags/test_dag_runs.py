"""Both DAGs run end to end under Airflow's own `dag.test()` (scheduler logic, task runner, deferral, mapping,
setup/teardown), with a stand-in `mass_ops.stages.api` recording calls and a stub model server for readiness.

The real stages are exercised by their own tests; this shows the wiring: which stage runs when, with which
arguments, and what is skipped.
"""

from __future__ import annotations

from collections import Counter

import pytest
from mass_ops_airflow.params import build_config

from tests.compute.model_server_stub import serve_in_thread
from tests.dags.dag_files import fresh_dag_module


@pytest.fixture
def model_server(stages):
    """A ready stub server that the stand-in `inference_up` reports, as the real local stage does."""
    server = serve_in_thread("mass-tiny-L0")
    endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1"
    servers = {"servers": [{"endpoint": endpoint, "served_name": "mass-tiny-L0"}]}
    for stage in ("inference_up", "evaluation_up", "nightly_up"):
        stages.results[stage] = servers
    yield endpoint
    server.shutdown()


def states(run) -> Counter:
    return Counter((ti.task_id, ti.state) for ti in run.get_task_instances())


@pytest.mark.slow(seconds=20)
def test_cycle_dag_runs_every_stage_in_order(airflow_db, stages, model_server):
    """Two searched tasks, one of them trained: each task's chain runs on its own; the task searched only skips its
    collection and ranking, and selection still runs."""
    stages.results.update(
        {
            "search_tasks": [51, 202],
            "collect_task": {"task_id": 51, "decision": "collect", "candidates": 2, "succeeded": 2},
            "register": {"generation": "L1", "generation_id": 1},
            "rollout_units": [["L0", 51, 0], ["L1", 51, 0]],
        }
    )
    conf = {"preset": "demo", "train_tasks": [51], "candidates": 2, "overrides": ["evaluation.tasks=[51, 60]"]}
    dag = fresh_dag_module("mass_cycle").dag
    for task in dag.tasks:  # a failure must fail the test now, not after Airflow's retry back-off
        task.retries = 0
    run = dag.test(run_conf=conf)
    assert run.state == "success", states(run)
    expected = [
        "validate_config", "inference_up", "search_tasks", "search_step", "search_step", "search_step",
        "search_step", "collect_task", "rank_task", "select", "inference_down",
        "render", "train", "select_checkpoint", "export", "register", "evaluation_up", "rollout_units",
        "rollout_unit", "rollout_unit", "evaluate", "evaluation_down", "report", "promotion_request", "promote",
    ]  # fmt: skip
    names = stages.names()
    assert Counter(names) == Counter(expected)
    # Independent branches may interleave; the stage order itself may not.
    order = ["validate_config", "search_tasks", "collect_task", "rank_task", "select", "render", "train",
             "select_checkpoint", "export", "register", "rollout_units", "evaluate", "report", "promotion_request",
             "promote"]  # fmt: skip
    assert [n for n in names if n in order] == order
    assert names.index("inference_down") > names.index("select") and names[-1] == "promote"
    for task in (51, 202):
        steps = [args[1:] for name, args in stages.calls if name == "search_step" and args[1] == task]
        assert steps == [(task, 0), (task, 1)], "versions run in order; those beyond search.iterations never run"
    assert [args[1:] for name, args in stages.calls if name in ("collect_task", "rank_task")] == [(51,), (51,)]
    counted = states(run)
    assert counted[("inner_loop.step_v2", "skipped")] == 2 and counted[("inner_loop.step_v11", "skipped")] == 2
    assert counted[("inner_loop.collect_task", "success")] == 1 and counted[("inner_loop.rank_task", "success")] == 1
    assert counted[("inner_loop.collect_task", "skipped")] == 1, "task 202 is searched only"
    assert counted[("inner_loop.rank_task", "skipped")] == 1
    assert counted[("select", "success")] == 1 and counted[("continue_cycle", "skipped")] == 1
    # promotion.require_approval is off (the stand-in's request says not required): no gate, promoted directly.
    assert counted[("promotion_request", "skipped")] == 1 and counted[("approve_promotion", "skipped")] == 1
    assert counted[("promote", "success")] == 1
    labels = {
        (ti.task_id, ti.map_index): ti.rendered_map_index
        for ti in run.get_task_instances()
        if ti.task_id in ("inner_loop.collect_task", "inner_loop.rank_task")
    }
    assert labels[("inner_loop.collect_task", 0)] == "collection-t51 (2 candidates)"
    assert labels[("inner_loop.rank_task", 0)] == "ranking-t51"
    rollouts = sorted(args[1:] for name, args in stages.calls if name == "rollout_unit")
    assert rollouts == [("L0", 51, 0), ("L1", 51, 0)]
    cycle = build_config(conf).cycle_name
    assert ui_links(run, "report") == {"Cycle report": f"/mass-ops/reports/{cycle}/"}, "the run's own cycle"


def test_teardown_runs_when_the_work_fails(airflow_db, stages, model_server):
    def broken(config, generation, logical_date):
        raise RuntimeError("judge endpoint down")

    stages.results.update({"nightly_targets": ["L1"], "nightly_evaluate": broken})
    dag = fresh_dag_module("mass_nightly_eval").dag
    for task in dag.tasks:
        task.retries = 0
    run = dag.test(run_conf={"preset": "demo"})
    assert run.state == "failed"
    counted = states(run)
    assert counted[("nightly_evaluate", "failed")] == 1
    assert counted[("nightly_inference_down", "success")] == 1, "the servers are stopped anyway"
    assert counted[("check_regression", "upstream_failed")] == 1
    assert stages.names().count("nightly_down") == 1
    assert counted[("nightly_report", "success")] == 1, "the night's report shows what was recorded anyway"


def ui_links(run, task_id: str) -> dict[str, str | None]:
    """A task instance's extra links as the API server computes them: the stored (serialized) DAG's task and what
    the worker recorded for the link when the task instance finished."""
    from airflow.models.dagbag import DBDagBag
    from airflow.utils.session import create_session

    with create_session() as session:
        task = DBDagBag().get_dag_for_run(run, session=session).get_task(task_id)
        ti = run.get_task_instance(task_id, session=session)
        return {name: task.get_extra_links(ti, name) for name in task.extra_links}


def test_a_regression_fails_the_night_and_its_report_is_still_written_and_linked(airflow_db, stages, model_server):
    night = "nightly-0123456789"
    stages.results.update(
        {
            "nightly_targets": ["L1"],
            "nightly_evaluate": {"generation": "L1", "win_rate": 0.3},
            "check_regression": {"regressions": ["L1: 0.30 is below the floor 0.45"]},
            "nightly_report": {"cycle": night, "markdown": "file:///r/report.md", "html": "file:///r/report.html"},
        }
    )
    dag = fresh_dag_module("mass_nightly_eval").dag
    for task in dag.tasks:
        task.retries = 0
    run = dag.test(run_conf={"preset": "demo"})
    assert run.state == "failed", "a regression fails the run"
    counted = states(run)
    assert counted[("check_regression", "failed")] == 1
    assert counted[("nightly_report", "success")] == 1
    assert stages.names().count("nightly_report") == 1
    assert ui_links(run, "nightly_report") == {"Cycle report": f"/mass-ops/reports/{night}/"}
