"""
### Nightly evaluation of the newest generations

Every night, evaluate the newest registered generation(s) on the test split, record the results keyed by
(logical date, generation), and fail loudly when a generation regresses beyond `evaluation.regression_threshold`.

Repair and history: `airflow backfill create --dag-id mass_nightly_eval --from-date … --to-date …` evaluates past
dates; because results are keyed by logical date and generation, a backfill (or a cleared task) redoes only the
missing evaluations. `catchup` is off: a paused deployment does not wake up to a burst of old runs.

The model servers of the evaluated generations are a setup/teardown pair around the evaluations, so they stop even
when an evaluation fails. **nightly_report** writes the report of the nightly results' cycle beside the regression
gate (its "Cycle report" link opens the page the Airflow API server serves at `/mass-ops/reports/<cycle>/`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from airflow.sdk import DAG, TriggerRule, get_current_context, task
from mass_ops_airflow import NIGHTLY_DAG_ID
from mass_ops_airflow.operators import InferenceServerOperator, InferenceServerTeardownOperator, ReportOperator
from mass_ops_airflow.params import NIGHTLY_KNOBS, cycle_params
from mass_ops_airflow.pools import GPU_POOL, INFERENCE_POOL

DAG_ID = NIGHTLY_DAG_ID
SCOPE = "nightly"
HOUR = dt.timedelta(hours=1)


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
    params=cycle_params(knobs=NIGHTLY_KNOBS),
    render_template_as_native_obj=True,
    tags=["mass-ops", "evaluation"],
    doc_md=__doc__,
) as dag:

    @task(execution_timeout=dt.timedelta(minutes=30))
    def nightly_targets(params: dict[str, Any] | None = None) -> list[str]:
        """Names of the generations to evaluate tonight (the newest registered ones)."""
        from airflow.sdk.exceptions import AirflowSkipException
        from mass_ops_airflow.cycle import run_stage

        names = [str(name) for name in run_stage("nightly_targets", params or {})]
        if not names:
            raise AirflowSkipException("no registered generation with a parent yet: nothing to evaluate")
        return names

    @task(execution_timeout=dt.timedelta(minutes=30))
    def serving_targets(generations: list[str], params: dict[str, Any] | None = None) -> list[dict[str, str]]:
        """What the servers load for those generations (Kubernetes backend; the local stage decides itself)."""
        from mass_ops_airflow.cycle import cycle_config, run_stage
        from mass_ops_airflow.operators.inference import registered_targets

        config = cycle_config(params or {})
        if config.compute.backend != "kubernetes":
            return []
        return registered_targets(config, run_stage("nightly_serving", params or {}, list(generations)))

    @task(pool=INFERENCE_POOL, execution_timeout=12 * HOUR, map_index_template="{{ unit_label }}")
    def nightly_evaluate(generation: str, params: dict[str, Any] | None = None) -> Any:
        """Evaluate one generation on the test split for this logical date (reused when already recorded)."""
        from mass_ops_airflow.cycle import run_stage

        get_current_context()["unit_label"] = generation  # type: ignore[typeddict-unknown-key]
        return run_stage("nightly_evaluate", params or {}, generation, _evaluation_date())

    @task(retries=0, execution_timeout=dt.timedelta(minutes=30))
    def check_regression(results: list[Any], params: dict[str, Any] | None = None) -> Any:
        """Compare with the previous results; a regression beyond the threshold fails this task (and the run)."""
        from mass_ops_airflow.cycle import run_stage

        verdict = run_stage("check_regression", params or {}, list(results))
        regressions = verdict.get("regressions") if isinstance(verdict, dict) else None
        if regressions:
            raise RuntimeError(f"regression beyond evaluation.regression_threshold: {regressions}")
        return verdict

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
    servers >> up >> results >> down
    down.as_teardown(setups=up)
    check_regression(results)
    # Beside the gate, not after it: a regression still fails the run, and the night's report is written anyway (also
    # when an evaluation failed); skipped only when there was nothing to evaluate.
    report = ReportOperator(
        task_id="nightly_report", stage="nightly_report", trigger_rule=TriggerRule.NONE_SKIPPED, execution_timeout=HOUR
    )
    results >> report
