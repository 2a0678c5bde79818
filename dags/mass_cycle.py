"""
### One MASS cycle: L(k) → L(k+1)

Trigger with a preset (`paper`, `cycle2`, `demo` or a config file) and the knobs of the form; every task rebuilds
the validated config from these params (XCom carries ids and URIs only).

validate_config → inference_up → inner_loop (per task: search steps → collect_task → rank_task) → select → render →
train → select_checkpoint → export → register L(k+1) → rollout → evaluate → report → promotion gate → promote →
continue_cycle. `compute.backend` decides where work runs (`local` or `kubernetes`); pools `mass_inference` and
`mass_gpu` bound the model server and GPU jobs. Every step in detail: docs/architecture.md ("The DAGs").
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import DAG, AssetAlias, TriggerRule, get_current_context, task, task_group
from mass_ops_airflow import CYCLE_DAG_ID
from mass_ops_airflow.operators import (
    EpisodePodOperator,
    EpisodeStageOperator,
    ExportJobOperator,
    InferenceServerOperator,
    InferenceServerTeardownOperator,
    ReportOperator,
    TaskCollectionOperator,
    TrainingJobOperator,
)
from mass_ops_airflow.params import MAX_SEARCH_ITERATIONS, cycle_params
from mass_ops_airflow.pools import GPU_POOL, INFERENCE_POOL

DAG_ID = CYCLE_DAG_ID
GENERATIONS = AssetAlias("mass-ops-generations")
GENERATION_URI = "mass-ops://generations/{name}"
EPISODE_LABEL = "{{ episode_label }}"
UNIT_LABEL = "{{ unit_label }}"

HOUR = dt.timedelta(hours=1)
# An episode may take runtime.episode_wall_clock_s (6 h in the paper presets) per attempt, up to 3 attempts.
EPISODE_TIMEOUT = 20 * HOUR
STEP_TIMEOUT = 24 * HOUR  # local backend: the step runs its episodes itself
# One task's candidates run in ⌈candidates / capacity⌉ waves of episodes; a timeout loses only the episodes in
# flight (finished candidates are reused by the retry).
COLLECTION_TIMEOUT = 72 * HOUR
SHORT_TIMEOUT = dt.timedelta(minutes=30)
# How long the promotion approval waits for a person; then it takes its default answer, Reject (nothing is promoted).
APPROVAL_TIMEOUT = dt.timedelta(days=7)

# Priorities (absolute, so Airflow does not add up downstream weights): a unit's weight is the length of its task's
# chain from it to the end of the inner loop (search versions left, then collection, then ranking). The pools hand
# a free slot to the highest weight first, so the model server serves the longest remaining chains — the critical
# path — before collection and ranking, which a search chain must never wait behind. These are the chain priorities
# of `mass_ops.critical_path` + 1 (the order the episode pool and a priority-scheduling server use; Airflow's least
# weight is 1), written out here so that parsing the DAG stays light; a test keeps the two equal.
RANK_PRIORITY = 1
COLLECT_PRIORITY = 2
WEIGHT_RULE = "absolute"


def search_priority(version: int) -> int:
    """Weight of search step `version`: its remaining versions, then collection and ranking."""
    return COLLECT_PRIORITY + 1 + (MAX_SEARCH_ITERATIONS - version)


# The v0 episodes come before step v0.
EPISODE_V0_PRIORITY = search_priority(0) + 1

DEFAULT_ARGS: dict[str, Any] = {
    "owner": "mass-ops",
    "retries": 2,
    "retry_delay": dt.timedelta(minutes=2),
    "retry_exponential_backoff": 2.0,
    "max_retry_delay": HOUR,
    "execution_timeout": 2 * HOUR,
}


def _label(text: str) -> None:
    """Name this mapped task instance in the UI (rendered through `map_index_template`)."""
    get_current_context()["unit_label"] = text  # type: ignore[typeddict-unknown-key]


def _stage(function: Callable[..., Any], params: dict[str, Any], *args: Any) -> Any:
    from mass_ops_airflow.cycle import run_stage

    return run_stage(function, params, *args)


with DAG(
    dag_id=DAG_ID,
    description="One MASS self-improvement cycle: RHI, collection, ranking, SFT, export, evaluation",
    schedule=None,
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    params=cycle_params(),
    render_template_as_native_obj=True,
    tags=["mass-ops", "cycle"],
    doc_md=__doc__,
) as dag:

    @task(retries=0, execution_timeout=SHORT_TIMEOUT)
    def validate_config(params: dict[str, Any] | None = None) -> Any:
        """Check the config against the catalogue and its cost estimate against the cycle budget (refused unless
        `allow_over_budget` is checked), freeze it into the cycle row; the estimate goes to the log and XCom."""
        from mass_ops.ops import api as ops

        params = params or {}
        result = _stage(ops.validate_config, params, *((True,) if params.get("allow_over_budget") else ()))
        if isinstance(result, dict) and "estimate" in result:
            import logging

            logging.getLogger(__name__).info("cycle estimate: %s", result["estimate"])
        return result

    @task(execution_timeout=SHORT_TIMEOUT)
    def search_tasks(params: dict[str, Any] | None = None) -> list[int]:
        """The tasks whose workflows RHI searches (train candidates)."""
        from mass_ops.stages import api

        return [int(t) for t in _stage(api.search_tasks, params or {})]

    @task(
        pool=INFERENCE_POOL,
        execution_timeout=STEP_TIMEOUT,
        map_index_template=UNIT_LABEL,
        priority_weight=search_priority(0),
        weight_rule=WEIGHT_RULE,
    )
    def step_v0(task_no: int, params: dict[str, Any] | None = None) -> Any:
        """RHI step 0 of one task: judge v0 against the reference, propose v1 (the episodes ran just before)."""
        from mass_ops.stages import api

        _label(f"search-t{task_no}-v0")
        return _stage(api.search_step, params or {}, task_no, 0)

    @task(
        pool=INFERENCE_POOL,
        execution_timeout=12 * HOUR,
        map_index_template=UNIT_LABEL,
        priority_weight=RANK_PRIORITY,
        weight_rule=WEIGHT_RULE,
    )
    def rank_task(task_no: int, params: dict[str, Any] | None = None) -> Any:
        """Ring tournament + self-judge + Bradley–Terry ranks of one task's trajectories (skipped with its
        collection)."""
        from mass_ops.stages import api

        _label(f"ranking-t{task_no}")
        return _stage(api.rank_task, params or {}, task_no)

    @task_group(group_id="inner_loop")
    def inner_loop(task_no: int) -> None:
        """One task's inner loop: its workflow search (each version one task instance, strictly in order), then its
        teacher collection, then its ranking — started as soon as the task's own previous phase is done.

        Version 0 needs two episodes (the bare reference and v0), which run as two pods side by side; every later
        version is one task: its episode's pod, then the step (judge calls, arbitration, the next proposal).
        """
        reference = EpisodePodOperator(
            task_id="reference_episode",
            kind="reference",
            task=task_no,
            pool=INFERENCE_POOL,
            execution_timeout=EPISODE_TIMEOUT,
            map_index_template=EPISODE_LABEL,
            priority_weight=EPISODE_V0_PRIORITY,
            weight_rule=WEIGHT_RULE,
        )
        first = EpisodePodOperator(
            task_id="episode_v0",
            kind="search",
            task=task_no,
            version=0,
            pool=INFERENCE_POOL,
            execution_timeout=EPISODE_TIMEOUT,
            map_index_template=EPISODE_LABEL,
            priority_weight=EPISODE_V0_PRIORITY,
            weight_rule=WEIGHT_RULE,
        )
        previous: Any = step_v0(task_no)
        [reference, first] >> previous
        for version in range(1, MAX_SEARCH_ITERATIONS + 1):
            step = EpisodeStageOperator(
                task_id=f"step_v{version}",
                kind="search",
                task=task_no,
                version=version,
                stage="search_step",
                pool=INFERENCE_POOL,
                execution_timeout=STEP_TIMEOUT,
                map_index_template=EPISODE_LABEL,
                priority_weight=search_priority(version),
                weight_rule=WEIGHT_RULE,
            )
            previous >> step
            previous = step
        # Pool slots: a collection instance runs up to `inference.max_concurrent_requests` episodes at once (the
        # stage's episode pool locally, its pods on Kubernetes) yet takes ONE slot of `mass_inference`. Asking for
        # that many slots would hold the instance back until the pool is nearly empty, i.e. until the other tasks'
        # search chains are done — the barrier this group removes — and `pool_slots` is fixed when the DAG is
        # parsed while the capacity is the run's config. With one slot the server may briefly get more requests than
        # the pool's size; it queues them (vLLM's --max-num-seqs), and the priorities above still give every freed
        # slot to a search step first.
        collected = TaskCollectionOperator(
            task_id="collect_task",
            task=task_no,
            pool=INFERENCE_POOL,
            pool_slots=1,
            execution_timeout=COLLECTION_TIMEOUT,
            map_index_template=UNIT_LABEL,
            priority_weight=COLLECT_PRIORITY,
            weight_rule=WEIGHT_RULE,
            # The versions beyond a run's search.iterations are skipped; the retained workflow is then final.
            trigger_rule=TriggerRule.NONE_FAILED,
        )
        previous >> collected >> rank_task(task_no)

    # A task searched only, or whose retained workflow is not collected, skips its collection and ranking; the
    # selection covers the collected training tasks (it reads each one's decision), so skipped chains let it run.
    @task(execution_timeout=SHORT_TIMEOUT, trigger_rule=TriggerRule.NONE_FAILED)
    def select(params: dict[str, Any] | None = None) -> Any:
        """Ranks 1–15 → train, rank 16 → validation."""
        from mass_ops.stages import api

        return _stage(api.select, params or {})

    @task(execution_timeout=4 * HOUR)
    def render(params: dict[str, Any] | None = None) -> Any:
        """Proxy logs → training windows with assistant-only loss masks."""
        from mass_ops.stages import api

        return _stage(api.render, params or {})

    @task(execution_timeout=SHORT_TIMEOUT)
    def select_checkpoint(params: dict[str, Any] | None = None) -> Any:
        """Minimum validation loss, step 0 excluded."""
        from mass_ops.stages import api

        return _stage(api.select_checkpoint, params or {})

    @task(execution_timeout=SHORT_TIMEOUT)
    def register(params: dict[str, Any] | None = None) -> Any:
        """Register L(k+1) with its lineage (served to its own evaluation; to the rest once promoted)."""
        from mass_ops.stages import api

        return _stage(api.register, params or {})

    @task(execution_timeout=SHORT_TIMEOUT)
    def promotion_request(params: dict[str, Any] | None = None) -> dict[str, str]:
        """The approval's subject and body (the evaluation's headline); skipped, and the gate with it, unless
        `promotion.require_approval`."""
        from airflow.sdk.exceptions import AirflowSkipException

        from mass_ops.stages import api

        request = _stage(api.promotion_request, params or {})
        if not request.get("required"):
            raise AirflowSkipException("promotion.require_approval is off: the new generation is promoted directly")
        return {"subject": f"Promote {request['generation']} over {request['baseline']}?", "body": request["headline"]}

    @task(outlets=[GENERATIONS], execution_timeout=SHORT_TIMEOUT, trigger_rule=TriggerRule.NONE_FAILED)
    def promote(params: dict[str, Any] | None = None) -> Any:
        """Serve L(k+1) from now on (approved, or no gate) and emit its asset event; skipped when rejected."""
        from airflow.sdk import Asset

        from mass_ops.stages import api

        context = get_current_context()
        answer = context["ti"].xcom_pull(task_ids="approve_promotion") or {}
        approved_by = (answer.get("responded_by_user") or {}).get("name")
        result = _stage(api.promote, params or {}, *((str(approved_by),) if approved_by else ()))
        name = str(result["generation"]) if isinstance(result, dict) and "generation" in result else None
        if name:
            extra = {k: v for k, v in result.items() if isinstance(v, str | int | float | bool)}
            context["outlet_events"][GENERATIONS].add(Asset(GENERATION_URI.format(name=name)), extra=extra)
        return result

    @task(execution_timeout=SHORT_TIMEOUT)
    def rollout_units(params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Bare-task rollouts (generation × task × replicate) of L(k) and L(k+1)."""
        from mass_ops.stages import api

        return [
            {"generation": str(g), "task": int(t), "replicate": int(r)}
            for g, t, r in _stage(api.rollout_units, params or {})
        ]

    @task(execution_timeout=24 * HOUR)
    def evaluate(params: dict[str, Any] | None = None) -> Any:
        """External pairwise judging of the rollouts, judge agreement."""
        from mass_ops.stages import api

        return _stage(api.evaluate, params or {})

    @task(retries=0, execution_timeout=SHORT_TIMEOUT)
    def continue_cycle(params: dict[str, Any] | None = None) -> dict[str, Any]:
        """With `auto_continue`, trigger the next cycle on the new generation (once: its run id is fixed)."""
        from airflow.sdk.exceptions import AirflowSkipException, DagRunTriggerException
        from mass_ops_airflow.cycle import cycle_config
        from mass_ops_airflow.params import build_config, next_cycle_params

        params = dict(params or {})
        if not params.get("auto_continue"):
            raise AirflowSkipException("auto_continue is off")
        conf = next_cycle_params(params, cycle_config(params))
        nxt = build_config(conf)  # refuse to trigger a run whose config would not validate
        raise DagRunTriggerException(
            trigger_dag_id=DAG_ID,
            dag_run_id=f"auto__{nxt.cycle_name}",
            conf=conf,
            reset_dag_run=False,
            skip_when_already_exists=True,
            wait_for_completion=False,
            allowed_states=["success"],
            failed_states=["failed"],
            poke_interval=60,
            deferrable=False,
            note=f"Continues after {cycle_config(params).cycle_name}",
        )

    validated = validate_config()
    inference_up = InferenceServerOperator(
        task_id="inference_up", serve="current", pool=GPU_POOL, execution_timeout=HOUR
    )
    inference_down = InferenceServerTeardownOperator(task_id="inference_down", execution_timeout=SHORT_TIMEOUT)
    tasks = search_tasks()
    chains = inner_loop.expand(task_no=tasks)
    selected = select()

    validated >> [inference_up, tasks]
    inference_up >> chains >> selected >> inference_down
    inference_down.as_teardown(setups=inference_up)

    rendered = render()
    train = TrainingJobOperator(task_id="train", pool=GPU_POOL, execution_timeout=48 * HOUR, retries=1)
    checkpoint = select_checkpoint()
    export = ExportJobOperator(task_id="export", pool=GPU_POOL, execution_timeout=8 * HOUR)
    registered = register()
    [selected, inference_down] >> rendered >> train >> checkpoint >> export >> registered

    evaluation_up = InferenceServerOperator(
        task_id="evaluation_inference_up",
        serve="evaluation",
        local_stage="evaluation_up",
        local_teardown_stage="evaluation_down",
        pool=GPU_POOL,
        execution_timeout=HOUR,
    )
    evaluation_down = InferenceServerTeardownOperator(
        task_id="evaluation_inference_down", local_stage="evaluation_down", execution_timeout=SHORT_TIMEOUT
    )
    rollout_list = rollout_units()
    rolled = EpisodeStageOperator.partial(
        task_id="rollout",
        kind="rollout",
        stage="rollout_unit",
        pool=INFERENCE_POOL,
        execution_timeout=EPISODE_TIMEOUT,
        map_index_template=EPISODE_LABEL,
    ).expand_kwargs(rollout_list)
    evaluated = evaluate()
    registered >> evaluation_up >> rollout_list >> rolled >> evaluated >> evaluation_down
    evaluation_down.as_teardown(setups=evaluation_up)
    # The cycle report (scoreboards, win rates with intervals, agreement, loss curves, cost); the task links it.
    reported = ReportOperator(task_id="report", stage="report", execution_timeout=2 * HOUR)
    # The gate: a person approves L(k+1) after reading the evaluation (and the report); a rejection skips promote and,
    # with it, the next cycle. The approval itself is never retried: an answer is not a fault.
    approval = ApprovalOperator(
        task_id="approve_promotion",
        subject="{{ ti.xcom_pull(task_ids='promotion_request')['subject'] }}",
        body="{{ ti.xcom_pull(task_ids='promotion_request')['body'] }}",
        defaults=ApprovalOperator.REJECT,
        response_timeout=APPROVAL_TIMEOUT,
        execution_timeout=SHORT_TIMEOUT,
        retries=0,
    )
    [evaluated, evaluation_down] >> reported >> promotion_request() >> approval >> promote() >> continue_cycle()
