"""The `mass_benchmarks` DAG: params, shape (setup/teardown around mapped trials, pools), and the callables calling
the stage functions with the run's config and the mapped (benchmark, trial)."""

from __future__ import annotations

from typing import Any

from airflow.sdk import TriggerRule
from airflow.sdk.execution_time.context import set_current_context
from mass_ops_airflow.pools import GPU_POOL, INFERENCE_POOL

from mass_ops.stages.api import benchmark_units as real_benchmark_units
from tests.dags.dag_files import KNOWN_POOLS, dag_module

PARAMS = {"preset": "demo", "generation": "L2", "benchmarks": ["ds", "swe"], "trials": 2, "limit": 5, "data_dir": None}


def dag():
    return dag_module("mass_benchmarks").dag


def call(task_id: str, context: dict | None = None, **kwargs: Any) -> Any:
    with set_current_context(context if context is not None else {}):
        return dag().get_task(task_id).python_callable(**kwargs)


def test_params_default_to_the_paper_suite_three_trials_and_no_limit():
    params = dag().params
    assert {"generation", "benchmarks", "trials", "limit", "data_dir", "preset", "overrides"} <= set(params)
    assert params["benchmarks"] == ["tb2", "swe", "ds", "asta"] and params["trials"] == 3
    assert params["limit"] is None and dag().schedule is None and dag().max_active_runs == 1


def test_shape_trials_are_mapped_between_the_server_setup_and_teardown():
    d = dag()
    up, down, trial = d.get_task("benchmarks_up"), d.get_task("benchmarks_down"), d.get_task("benchmark_trial")
    assert up.is_setup and down.is_teardown and down.trigger_rule == TriggerRule.ALL_DONE_SETUP_SUCCESS
    assert up.pool == GPU_POOL and trial.pool == INFERENCE_POOL  # episodes hold inference slots
    assert trial.map_index_template == "{{ unit_label }}"
    assert {"benchmarks_up", "benchmark_units"} <= set(trial.upstream_task_ids)
    assert down.upstream_task_ids >= {"benchmark_trial"}
    for t in d.tasks:
        assert t.owner == "mass-ops" and t.execution_timeout is not None and t.pool in KNOWN_POOLS


def test_callables_call_the_stages_with_the_config_and_the_mapped_unit(stages):
    stages.results.update({"benchmark_units": [["ds", 0], ["ds", 1], ["swe", 0], ["swe", 1]]})
    assert call("benchmark_units", params=PARAMS) == [["ds", 0], ["ds", 1], ["swe", 0], ["swe", 1]]
    name, (config, benchmarks, trials) = stages.calls[-1]
    assert (name, benchmarks, trials) == ("benchmark_units", ["ds", "swe"], 2)
    assert config.cycle_name  # the config was built from the run's config params alone (no unknown-param error)
    call("benchmarks_up", params=PARAMS)
    assert stages.calls[-1][0] == "benchmark_up" and stages.calls[-1][1][1:] == ("L2",)
    call("benchmarks_down", params=PARAMS)
    assert stages.names()[-1] == "benchmark_down"


def test_the_dag_maps_one_trial_task_per_benchmark_and_trial(stages):
    stages.passthrough["benchmark_units"] = real_benchmark_units  # the real stage: the DAG maps over its units
    assert call("benchmark_units", params={**PARAMS, "benchmarks": ["tb2", "asta"], "trials": 3}) == [
        ["tb2", 0], ["tb2", 1], ["tb2", 2], ["asta", 0], ["asta", 1], ["asta", 2],
    ]  # fmt: skip


def test_the_mapped_trial_is_the_benchmark_operator_which_strips_the_run_params(stages):
    from mass_ops_airflow.operators.benchmark import BenchmarkTrialOperator

    mapped = dag().get_task("benchmark_trial")
    assert mapped.operator_class is BenchmarkTrialOperator
    run_params = mapped.partial_kwargs["run_params"]
    assert set(run_params) == {"generation", "benchmarks", "trials", "limit", "data_dir"}
    # What the operator does with them: the local trial through the stage, the config built without them.
    operator = BenchmarkTrialOperator(task_id="t", unit=["swe", 1], run_params=run_params)
    context: dict[str, Any] = {"params": PARAMS}
    operator.execute(context)  # type: ignore[arg-type]
    name, (config, *args) = stages.calls[-1]
    assert (name, tuple(args)) == ("benchmark_trial", ("swe", "L2", 1, 5, None)) and config.cycle_name
    assert context["unit_label"] == "swe t1"


def test_the_dag_offers_exactly_the_registry_suite_in_its_order():
    """The DAG writes the suite out (parsing stays light); it must stay the benchmark registry's `SUITE`."""
    from mass_ops.evaluation.benchmarks.sources import SUITE

    assert list(SUITE) == dag_module("mass_benchmarks").SUITE
    assert dag().params.get_param("benchmarks").schema["items"]["enum"] == list(SUITE)
