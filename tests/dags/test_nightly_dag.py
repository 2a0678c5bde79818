"""Structure of the nightly evaluation DAG: cron, no catchup, servers as setup/teardown, regression gate last; the
optional benchmark slice mapped over (benchmark, generation) inside the servers' setup/teardown, checked first, skipped
when empty, and run under `dag.test()` with a stand-in `mass_ops.stages.api`."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

import pytest
from airflow.sdk import TriggerRule
from airflow.sdk.definitions.param import ParamValidationError
from airflow.sdk.exceptions import AirflowSkipException
from airflow.sdk.execution_time.context import set_current_context
from mass_ops_airflow.operators.benchmark import BenchmarkTrialOperator
from mass_ops_airflow.params import NIGHTLY_KNOBS, NIGHTLY_RUN_PARAMS
from mass_ops_airflow.pools import GPU_POOL, INFERENCE_POOL

from mass_ops.errors import InputError
from mass_ops.stages import nightly as nightly_stages
from tests.compute.model_server_stub import serve_in_thread
from tests.dags.dag_files import KNOWN_POOLS, dag_module, fresh_dag_module

NIGHT = dt.datetime(2026, 11, 30, 3, tzinfo=dt.UTC)
SLICE = {"preset": "demo", "benchmark_slice": ["ds", "swe"], "benchmark_slice_instances": 2, "benchmark_data_dir": "/d"}


@pytest.fixture(scope="module")
def dag():
    return dag_module("mass_nightly_eval").dag


def test_schedule_and_catchup(dag):
    assert dag.schedule == "0 3 * * *" and dag.timetable.expression == "0 3 * * *"
    assert dag.catchup is False and dag.max_active_runs == 1
    assert set(dag.params) == {"preset", "overrides", *NIGHTLY_KNOBS, *NIGHTLY_RUN_PARAMS}


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
    # Not downstream of the gate: a regression fails the run and the report is still written. After the benchmark
    # slice (through benchmark_slice_done, which is never skipped), so that it shows the slice's scores.
    assert report.upstream_task_ids == {"nightly_evaluate", "benchmark_slice_done"}
    assert "check_regression" not in report.get_flat_relative_ids(upstream=True)
    # Written when an evaluation failed too; skipped only when there was nothing to evaluate.
    assert report.trigger_rule == TriggerRule.NONE_SKIPPED


# -- the benchmark slice ---------------------------------------------------------------------------------------------


def call(task_id: str, context: dict | None = None, **kwargs: Any) -> Any:
    with set_current_context(context if context is not None else {}):
        return dag_module("mass_nightly_eval").dag.get_task(task_id).python_callable(**kwargs)


def test_the_slice_params_default_to_no_slice_and_validate(dag):
    assert dag.params["benchmark_slice"] == [] and dag.params["benchmark_slice_instances"] == 5
    assert dag.params["benchmark_data_dir"] is None
    instances = dag.params.get_param("benchmark_slice_instances")
    assert instances.resolve(3) == 3
    for bad in (0, "5", None):
        with pytest.raises(ParamValidationError):
            instances.resolve(bad)
    with pytest.raises(ParamValidationError):
        dag.params.get_param("benchmark_slice").resolve("ds")  # a list of names, not one


def test_the_slice_is_mapped_over_its_units_inside_the_servers_setup_and_teardown(dag):
    up, down = dag.get_task("nightly_inference_up"), dag.get_task("nightly_inference_down")
    units, trial = dag.get_task("benchmark_slice_units"), dag.get_task("benchmark_slice_trial")
    assert units.upstream_task_ids == {"nightly_targets"}
    assert trial.operator_class is BenchmarkTrialOperator  # mapped: one task instance per unit
    assert trial.expand_input.value.keys() == {"unit"}
    assert trial.partial_kwargs["stage_prefix"] == "nightly_benchmark"
    assert tuple(trial.partial_kwargs["run_params"]) == NIGHTLY_RUN_PARAMS
    assert trial.pool == INFERENCE_POOL and trial.map_index_template == "{{ unit_label }}"
    # Between the servers' setup and teardown: started after the servers are up, which stop only after it.
    assert {"nightly_inference_up", "benchmark_slice_units"} == trial.upstream_task_ids
    assert {"nightly_evaluate", "benchmark_slice_trial"} <= down.upstream_task_ids and up.is_setup
    # A failed slice trial fails the run: benchmark_slice_scores (all upstream succeeded) is a leaf of the run.
    scores = dag.get_task("benchmark_slice_scores")
    assert scores.upstream_task_ids == {"benchmark_slice_trial"} and not scores.downstream_task_ids
    assert scores.trigger_rule == TriggerRule.ALL_SUCCESS
    done = dag.get_task("benchmark_slice_done")
    assert done.upstream_task_ids == {"benchmark_slice_trial"} and done.trigger_rule == TriggerRule.NONE_FAILED
    for task in dag.tasks:
        assert task.owner == "mass-ops" and task.execution_timeout is not None and task.pool in KNOWN_POOLS


def test_an_unknown_slice_benchmark_fails_the_first_task_in_one_line(stages):
    stages.passthrough["nightly_benchmark_slice"] = nightly_stages.nightly_benchmark_slice
    with pytest.raises(InputError) as refused:
        call("nightly_targets", params={**SLICE, "benchmark_slice": ["ds", "mmlu"]})
    assert "benchmark_slice ['mmlu'] unknown" in str(refused.value) and "\n" not in str(refused.value)
    assert stages.names() == [], "refused before tonight's targets are looked up"
    # A valid slice is checked with the run's config (built without the slice params) and its own values.
    stages.passthrough.pop("nightly_benchmark_slice")
    stages.results["nightly_targets"] = ["L1"]
    assert call("nightly_targets", params=SLICE) == ["L1"]
    (name, (config, *args)), _ = stages.calls
    assert (name, args) == ("nightly_benchmark_slice", [["ds", "swe"], 2, "/d"]) and config.cycle_name


def test_an_empty_slice_skips_its_units_without_any_stage(stages):
    stages.results["nightly_targets"] = ["L1"]
    assert call("nightly_targets", params={"preset": "demo", "benchmark_slice": []}) == ["L1"]
    with pytest.raises(AirflowSkipException, match="no benchmark slice tonight"):
        call("benchmark_slice_units", {"logical_date": NIGHT}, generations=["L1"], params={"preset": "demo"})
    assert stages.names() == ["nightly_targets"]


def test_the_units_task_asks_the_stage_for_tonights_units(stages):
    unit = {"benchmark": "ds", "generation": "L1", "trial": 109_830, "limit": 2, "data_dir": "/d"}
    stages.results["nightly_benchmark_units"] = [unit]
    assert call("benchmark_slice_units", {"logical_date": NIGHT}, generations=["L1"], params=SLICE) == [unit]
    name, (config, *args) = stages.calls[-1]
    assert (name, args) == ("nightly_benchmark_units", [["L1"], ["ds", "swe"], 2, NIGHT.isoformat(), "/d"])
    assert config.cycle_name


def test_a_slice_unit_runs_the_nightly_stages_for_its_generation(stages):
    """What the mapped operator does with one unit on the local backend: the nightly slice's trial stage with the
    unit's generation, trial, limit and folder, the config built without the slice params."""
    mapped = dag_module("mass_nightly_eval").dag.get_task("benchmark_slice_trial")
    unit = {"benchmark": "swe", "generation": "L0", "trial": 109_830, "limit": 2, "data_dir": "/d"}
    operator = BenchmarkTrialOperator(task_id="t", unit=unit, **mapped.partial_kwargs)
    context: dict[str, Any] = {"params": SLICE}
    operator.execute(context)  # type: ignore[arg-type]
    name, (config, *args) = stages.calls[-1]
    assert (name, args) == ("nightly_benchmark_trial", ["swe", "L0", 109_830, 2, "/d"]) and config.cycle_name
    assert context["unit_label"] == "swe L0 t109830"


@pytest.fixture
def nightly_server(stages):
    """A ready stub server that the stand-in `nightly_up` reports, as the real local stage does."""
    server = serve_in_thread("mass-tiny-L1")
    endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1"
    stages.results["nightly_up"] = {"servers": [{"endpoint": endpoint, "served_name": "mass-tiny-L1"}]}
    yield endpoint
    server.shutdown()


def run_night(stages, conf: dict[str, Any], **results: Any) -> Any:
    """Run the nightly DAG for NIGHT under `dag.test()` with `conf`; the stand-in stages answer `results` (else a
    night with one target and a slice trial scoring 0.5)."""
    stages.results.update(
        {
            "nightly_targets": ["L1"],
            "nightly_evaluate": {"generation": "L1", "baseline": "L0", "date": "20261130T030000"},
            "check_regression": {"regressions": []},
            "nightly_benchmark_units": lambda config, generations, benchmarks, instances, date, data_dir: [
                {"benchmark": b, "generation": g, "trial": 109_830, "limit": instances, "data_dir": data_dir}
                for b in benchmarks
                for g in ("L1", "L0")
            ],
            "nightly_benchmark_trial": lambda config, benchmark, generation, trial, limit, data_dir: {
                "benchmark": benchmark, "generation": generation, "trial": trial, "mean": 0.5,
            },
        }
    )  # fmt: skip
    stages.results.update(results)
    dag = fresh_dag_module("mass_nightly_eval").dag
    for task in dag.tasks:  # a failure must fail the test now, not after Airflow's retry back-off
        task.retries = 0
    return dag.test(logical_date=NIGHT, run_conf=conf)


def states(run) -> Counter:
    return Counter((ti.task_id, ti.state) for ti in run.get_task_instances())


def test_a_night_with_a_slice_runs_each_benchmark_on_each_served_generation_while_the_servers_are_up(
    airflow_db, stages, nightly_server
):
    run = run_night(stages, SLICE)
    assert run.state == "success", states(run)
    counted = states(run)
    assert counted[("benchmark_slice_trial", "success")] == 4
    trials = sorted(tuple(args[1:]) for name, args in stages.calls if name == "nightly_benchmark_trial")
    assert trials == [
        ("ds", "L0", 109_830, 2, "/d"), ("ds", "L1", 109_830, 2, "/d"),
        ("swe", "L0", 109_830, 2, "/d"), ("swe", "L1", 109_830, 2, "/d"),
    ]  # fmt: skip
    names = stages.names()
    first, last = names.index("nightly_benchmark_trial"), len(names) - 1 - names[::-1].index("nightly_benchmark_trial")
    assert names.index("nightly_up") < first and last < names.index("nightly_down"), "inside the servers' lifetime"
    assert last < names.index("nightly_report"), "the report is written after the slice"
    assert names.index("nightly_benchmark_slice") < names.index("nightly_targets"), "checked first"
    labels = {ti.rendered_map_index for ti in run.get_task_instances() if ti.task_id == "benchmark_slice_trial"}
    assert labels == {"ds L1 t109830", "ds L0 t109830", "swe L1 t109830", "swe L0 t109830"}


def test_a_night_without_a_slice_skips_every_slice_task(airflow_db, stages, nightly_server):
    run = run_night(stages, {"preset": "demo"})
    assert run.state == "success", states(run)
    counted = states(run)
    for task_id in ("benchmark_slice_units", "benchmark_slice_trial", "benchmark_slice_scores"):
        assert counted[(task_id, "skipped")] == 1, task_id
    assert counted[("benchmark_slice_done", "success")] == 1 and counted[("nightly_report", "success")] == 1
    assert not [name for name in stages.names() if name.startswith("nightly_benchmark")]


def test_a_failed_slice_trial_fails_the_night_and_the_report_is_still_written(airflow_db, stages, nightly_server):
    def broken(config, benchmark, generation, trial, limit, data_dir):
        if generation == "L0":
            raise RuntimeError("dataset unreadable")
        return {"benchmark": benchmark, "generation": generation, "mean": 1.0}

    run = run_night(stages, {**SLICE, "benchmark_slice": ["ds"]}, nightly_benchmark_trial=broken)
    counted = states(run)
    assert run.state == "failed", counted
    assert counted[("benchmark_slice_trial", "failed")] == 1 and counted[("benchmark_slice_trial", "success")] == 1
    assert counted[("benchmark_slice_scores", "upstream_failed")] == 1
    assert counted[("nightly_inference_down", "success")] == 1 and counted[("nightly_report", "success")] == 1
    assert counted[("check_regression", "success")] == 1
