"""
### Nightly evaluation of the newest generations

Every night, evaluate the newest registered generation(s) on the test split, record the results keyed by
(logical date, generation), and fail loudly when a generation regresses beyond `evaluation.regression_threshold`.
A backfill or a cleared task redoes only the missing evaluations; `catchup` is off. Optional: a deadline alert
(`MASS_NIGHTLY_DEADLINE_HOURS`) and a public-benchmark slice (`benchmark_slice`, `benchmark_slice_instances`).
Servers are a setup/teardown pair; **nightly_report** writes the night's report. Design: docs/architecture.md
("The DAGs").
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, TriggerRule, get_current_context, task
from mass_ops_airflow import NIGHTLY_DAG_ID
from mass_ops_airflow.alerts import nightly_deadline
from mass_ops_airflow.operators import InferenceServerOperator, InferenceServerTeardownOperator, ReportOperator
from mass_ops_airflow.operators.benchmark import BenchmarkTrialOperator
from mass_ops_airflow.params import NIGHTLY_KNOBS, NIGHTLY_RUN_PARAMS, cycle_params, nightly_slice_params
from mass_ops_airflow.params import config_params as strip_run_params
from mass_ops_airflow.pools import GPU_POOL, INFERENCE_POOL

DAG_ID = NIGHTLY_DAG_ID
SCOPE = "nightly"
HOUR = dt.timedelta(hours=1)


def config_params(params: dict[str, Any] | None) -> dict[str, Any]:
    """The run's params without the benchmark slice's (what the config builder reads)."""
    return strip_run_params(params, NIGHTLY_RUN_PARAMS)


def _slice(params: dict[str, Any] | None) -> tuple[list[str], Any, Any]:
    """The run's benchmark slice: (benchmarks, instances per benchmark, dataset folder)."""
    chosen = params or {}
    return (
        list(chosen.get("benchmark_slice") or []),
        chosen.get("benchmark_slice_instances"),
        chosen.get("benchmark_data_dir"),
    )


def _evaluation_date() -> str:
    """The run's logical date (ISO); a manual run without one uses its run-after time."""
    context = get_current_context()
    when = context.get("logical_date") or context["dag_run"].run_after
    return when.isoformat()


with DAG(
    dag_id=DAG_ID,
    description="Nightly test-split evaluation of the newest generations, failing on a regression",
    schedule="0 3 * * *",
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    default_args={
        "owner": "mass-ops",
        "retries": 2,
        "retry_delay": dt.timedelta(minutes=5),
        "retry_exponential_backoff": 2.0,
        "max_retry_delay": HOUR,
        "execution_timeout": 2 * HOUR,
    },
    params={**cycle_params(knobs=NIGHTLY_KNOBS), **nightly_slice_params()},
    render_template_as_native_obj=True,
    deadline=nightly_deadline(),  # MASS_NIGHTLY_DEADLINE_HOURS after queueing (default 6; 0 = none)
    tags=["mass-ops", "evaluation"],
    doc_md=__doc__,
) as dag:

    @task(execution_timeout=dt.timedelta(minutes=30))
    def nightly_targets(params: dict[str, Any] | None = None) -> list[str]:
        """Names of the generations to evaluate tonight (the newest registered ones); first, the benchmark slice is
        checked (an unknown benchmark or a missing dataset fails here, in one line, before any server starts)."""
        from airflow.sdk.exceptions import AirflowSkipException
        from mass_ops_airflow.cycle import run_stage

        from mass_ops.stages import api

        benchmarks, instances, data_dir = _slice(params)
        if benchmarks:  # an empty slice is no work, not even a check
            run_stage(api.nightly_benchmark_slice, config_params(params), benchmarks, instances, data_dir)
        names = [str(name) for name in run_stage(api.nightly_targets, config_params(params))]
        if not names:
            raise AirflowSkipException("no registered generation with a parent yet: nothing to evaluate")
        return names

    @task(execution_timeout=dt.timedelta(minutes=30))
    def serving_targets(generations: list[str], params: dict[str, Any] | None = None) -> list[dict[str, str]]:
        """What the servers load for those generations (Kubernetes backend; the local stage decides itself)."""
        from mass_ops_airflow.cycle import cycle_config, run_stage
        from mass_ops_airflow.operators.inference import registered_targets

        from mass_ops.compute.backend import backend_for
        from mass_ops.stages import api

        config = cycle_config(config_params(params))
        if backend_for(config).runs_in_process:
            return []
        return registered_targets(config, run_stage(api.nightly_serving, config_params(params), list(generations)))

    @task(pool=INFERENCE_POOL, execution_timeout=12 * HOUR, map_index_template="{{ unit_label }}")
    def nightly_evaluate(generation: str, params: dict[str, Any] | None = None) -> Any:
        """Evaluate one generation on the test split for this logical date (reused when already recorded)."""
        from mass_ops_airflow.cycle import run_stage

        from mass_ops.stages import api

        get_current_context()["unit_label"] = generation  # type: ignore[typeddict-unknown-key]
        return run_stage(api.nightly_evaluate, config_params(params), generation, _evaluation_date())

    @task(retries=0, execution_timeout=dt.timedelta(minutes=30))
    def check_regression(results: list[Any], params: dict[str, Any] | None = None) -> Any:
        """Compare with the previous results; a regression beyond the threshold fails this task (and the run)."""
        from mass_ops_airflow.cycle import run_stage

        from mass_ops.stages import api

        verdict = run_stage(api.check_regression, config_params(params), list(results))
        regressions = verdict.get("regressions") if isinstance(verdict, dict) else None
        if regressions:
            raise RuntimeError(f"regression beyond evaluation.regression_threshold: {regressions}")
        return verdict

    @task(execution_timeout=dt.timedelta(minutes=30))
    def benchmark_slice_units(generations: list[str], params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Tonight's benchmark slice: one unit per (benchmark, served generation), the night's trial; skipped (and
        with it every slice task) when the slice is empty."""
        from airflow.sdk.exceptions import AirflowSkipException
        from mass_ops_airflow.cycle import run_stage

        from mass_ops.stages import api

        benchmarks, instances, data_dir = _slice(params)
        if not benchmarks:
            raise AirflowSkipException("no benchmark slice tonight (benchmark_slice is empty)")
        date = _evaluation_date()
        units = run_stage(
            api.nightly_benchmark_units, config_params(params), list(generations), benchmarks, instances, date, data_dir
        )
        return [dict(unit) for unit in units]

    @task(execution_timeout=dt.timedelta(minutes=30))
    def benchmark_slice_scores(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The slice's score per (benchmark, generation) tonight, in the log and XCom; a failed slice trial leaves
        this task upstream_failed, which fails the run (as a failed evaluation leaves the regression gate)."""
        import logging

        scores = [trial["result"] for trial in trials]
        for score in scores:
            logging.getLogger(__name__).info(
                "%s %s t%s: mean %s (%s of %s tasks scored, %s)",
                score.get("benchmark"),
                score.get("generation"),
                score.get("trial"),
                score.get("mean"),
                score.get("scored"),
                score.get("attempted"),
                score.get("evaluator"),
            )
        return scores

    # One benchmark of the slice for one generation, on tonight's servers (instances already recorded are skipped).
    # Kubernetes: each instance's grader Job from the benchmark's image, as in mass_benchmarks (the operator).
    benchmark_slice_trial = BenchmarkTrialOperator.partial(
        task_id="benchmark_slice_trial",
        pool=INFERENCE_POOL,
        execution_timeout=12 * HOUR,
        map_index_template="{{ unit_label }}",
        run_params=NIGHTLY_RUN_PARAMS,
        stage_prefix="nightly_benchmark",
    )

    generations = nightly_targets()
    servers = serving_targets(generations)
    up = InferenceServerOperator(
        task_id="nightly_inference_up",
        serve=servers,
        scope=SCOPE,
        local_stage="nightly_up",
        local_teardown_stage="nightly_down",
        pool=GPU_POOL,
        execution_timeout=HOUR,
    )
    down = InferenceServerTeardownOperator(task_id="nightly_inference_down", scope=SCOPE, local_stage="nightly_down")
    results = nightly_evaluate.expand(generation=generations)
    slice_trials = benchmark_slice_trial.expand(unit=benchmark_slice_units(generations))
    servers >> up >> [results, slice_trials] >> down
    down.as_teardown(setups=up)
    benchmark_slice_scores(slice_trials.output)
    # What the report waits for: the slice finished, ran or skipped (empty, or nothing to evaluate); no work.
    slice_done = EmptyOperator(task_id="benchmark_slice_done", trigger_rule=TriggerRule.NONE_FAILED)
    slice_trials >> slice_done
    check_regression(results)
    # Beside the gate, not after it: a regression still fails the run, and the night's report is written anyway (also
    # when an evaluation or the slice failed); after the slice, so that it shows the slice's scores; skipped only
    # when there was nothing to evaluate (nightly_evaluate skipped; slice_done never is).
    report = ReportOperator(
        task_id="nightly_report", stage="nightly_report", trigger_rule=TriggerRule.NONE_SKIPPED, execution_timeout=HOUR
    )
    [results, slice_done] >> report
