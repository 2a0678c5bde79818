"""
### Public benchmarks of one generation

Runs a chosen generation on the public benchmarks (tb2, swe, ds, asta): one mapped task per (benchmark, trial), each
running the benchmark's tasks as episodes on the generation's server and grading them with the official evaluator.
Resumable per instance: a cleared or retried task skips every instance whose score is recorded.

Params: `generation`, `benchmarks`, `trials`, `limit`, `data_dir` (empty: `$MASS_BENCHMARK_DATA`), plus the cycle's
preset and overrides. Nothing is downloaded. Design: docs/architecture.md ("The DAGs").
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from airflow.sdk import DAG, Param, task
from mass_ops_airflow.operators.benchmark import BenchmarkTrialOperator
from mass_ops_airflow.params import config_params as strip_run_params
from mass_ops_airflow.params import cycle_params
from mass_ops_airflow.pools import GPU_POOL, INFERENCE_POOL

DAG_ID = "mass_benchmarks"
HOUR = dt.timedelta(hours=1)
SUITE = ["tb2", "swe", "ds", "asta"]  # mass_ops.evaluation.benchmarks.sources.SUITE (not imported: parse time)
# The run's params that choose the benchmarks, not the cycle's config: never passed to the config builder.
BENCHMARK_PARAMS = ("generation", "benchmarks", "trials", "limit", "data_dir")


def config_params(params: dict[str, Any] | None) -> dict[str, Any]:
    """The run's params without the benchmark choice (what the config builder reads)."""
    return strip_run_params(params, BENCHMARK_PARAMS)


with DAG(
    dag_id=DAG_ID,
    description="A generation on the public benchmarks: benchmarks × trials mapped, resumable per instance",
    schedule=None,
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
    params={
        **cycle_params(knobs=("compute_backend", "max_concurrent_requests")),
        "generation": Param("L1", type="string", minLength=1, description="The registered generation to run"),
        "benchmarks": Param(SUITE, type="array", items={"type": "string", "enum": SUITE}, minItems=1),
        "trials": Param(3, type="integer", minimum=1, description="Trials per benchmark (the paper: 3)"),
        "limit": Param(None, type=["null", "integer"], minimum=1, description="First N tasks per benchmark"),
        "data_dir": Param(None, type=["null", "string"], description="Dataset folder (else $MASS_BENCHMARK_DATA)"),
    },
    render_template_as_native_obj=True,
    tags=["mass-ops", "evaluation", "benchmarks"],
    doc_md=__doc__,
) as dag:

    @task(execution_timeout=dt.timedelta(minutes=30))
    def benchmark_units(params: dict[str, Any] | None = None) -> list[list[Any]]:
        """(benchmark, trial) of every trial of this run."""
        from mass_ops_airflow.cycle import run_stage

        from mass_ops.stages import api

        chosen = params or {}
        units = run_stage(api.benchmark_units, config_params(chosen), list(chosen["benchmarks"]), chosen["trials"])
        return [list(unit) for unit in units]

    @task(pool=GPU_POOL, execution_timeout=HOUR)
    def benchmarks_up(params: dict[str, Any] | None = None) -> Any:
        """Local backend: serve the generation (on Kubernetes the cycle's evaluation servers serve it)."""
        from mass_ops_airflow.cycle import run_stage

        from mass_ops.stages import api

        return run_stage(api.benchmark_up, config_params(params), (params or {})["generation"])

    @task(execution_timeout=dt.timedelta(minutes=30))
    def benchmarks_down(params: dict[str, Any] | None = None) -> Any:
        """Stop the local benchmark server (also when a trial failed)."""
        from mass_ops_airflow.cycle import run_stage

        from mass_ops.stages import api

        return run_stage(api.benchmark_down, config_params(params))

    # One trial of one benchmark (instances already scored are skipped). Kubernetes: each instance's grader Job
    # from the benchmark's image is created, waited for in the triggerer and its result recorded (the operator).
    benchmark_trial = BenchmarkTrialOperator.partial(
        task_id="benchmark_trial",
        pool=INFERENCE_POOL,
        execution_timeout=48 * HOUR,
        map_index_template="{{ unit_label }}",
        run_params=BENCHMARK_PARAMS,
    )

    units = benchmark_units()
    up = benchmarks_up()
    down = benchmarks_down()
    trials = benchmark_trial.expand(unit=units)
    units >> up >> trials >> down
    down.as_teardown(setups=up)
