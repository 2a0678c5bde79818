"""Structure of the cycle DAG: order of stages, one pipelined inner-loop group per task (a task instance per RHI
version, then the task's collection and ranking), priorities, setup/teardown, pools, retries, assets."""

from __future__ import annotations

import pytest
from airflow.sdk import TriggerRule
from mass_ops_airflow.params import KNOBS, MAX_SEARCH_ITERATIONS
from mass_ops_airflow.pools import GPU_POOL, INFERENCE_POOL

from mass_ops.critical_path import chain_priority
from tests.dags.dag_files import dag_module


@pytest.fixture(scope="module")
def dag():
    return dag_module("mass_cycle").dag


def upstream(dag, task_id: str) -> set[str]:
    return set(dag.get_task(task_id).upstream_task_ids)


def test_run_is_triggered_with_the_form(dag):
    assert dag.dag_id == "mass_cycle" and dag.schedule is None
    assert dag.catchup is False and dag.max_active_runs == 1
    assert set(dag.params) == {
        "preset",
        "overrides",
        "auto_continue",
        "allow_over_budget",
        *(k.param for k in KNOBS),
    }
    dag.params.validate()


def test_stage_order(dag):
    chain = [
        ("validate_config", "inference_up"),
        ("validate_config", "search_tasks"),
        ("search_tasks", "inner_loop.reference_episode"),
        ("inference_up", "inner_loop.reference_episode"),
        ("inference_up", "inner_loop.episode_v0"),
        (f"inner_loop.step_v{MAX_SEARCH_ITERATIONS}", "inner_loop.collect_task"),
        ("inner_loop.collect_task", "inner_loop.rank_task"),
        ("inner_loop.rank_task", "select"),
        ("select", "inference_down"),
        ("select", "render"),
        ("inference_down", "render"),
        ("render", "train"),
        ("train", "select_checkpoint"),
        ("select_checkpoint", "export"),
        ("export", "register"),
        ("register", "evaluation_inference_up"),
        ("evaluation_inference_up", "rollout_units"),
        ("rollout_units", "rollout"),
        ("rollout", "evaluate"),
        ("evaluate", "evaluation_inference_down"),
        ("evaluate", "report"),
        ("evaluation_inference_down", "report"),
        ("report", "promotion_request"),
        ("promotion_request", "approve_promotion"),
        ("approve_promotion", "promote"),
        ("promote", "continue_cycle"),
    ]
    for before, after in chain:
        assert before in upstream(dag, after), f"{before} must run before {after}"


def test_the_search_runs_each_version_as_its_own_task_in_order(dag):
    steps = [f"inner_loop.step_v{k}" for k in range(MAX_SEARCH_ITERATIONS + 1)]
    assert all(s in dag.task_dict for s in steps)
    assert f"inner_loop.step_v{MAX_SEARCH_ITERATIONS + 1}" not in dag.task_dict
    both = {"inner_loop.reference_episode", "inner_loop.episode_v0"}
    assert both <= upstream(dag, "inner_loop.step_v0"), "both v0 episodes first"
    for k in range(1, MAX_SEARCH_ITERATIONS + 1):
        step = dag.get_task(f"inner_loop.step_v{k}")
        assert f"inner_loop.step_v{k - 1}" in step.upstream_task_ids, "version k needs step k-1's proposal"
        assert (step.kind, step.version, step.stage) == ("search", k, "search_step")


def test_each_task_s_chain_is_one_mapped_group_and_only_select_waits_for_all(dag):
    """Pipelining: a task's collection follows its own last search step and its ranking its own collection, inside
    the group mapped per task (one instance each); nothing outside the group sits between them; `select` waits for
    every group."""
    for task_id in ("inner_loop.step_v0", "inner_loop.collect_task", "inner_loop.rank_task"):
        group = dag.get_task(task_id).get_closest_mapped_task_group()
        assert group is not None and group.group_id == "inner_loop", task_id
    collect, rank = dag.get_task("inner_loop.collect_task"), dag.get_task("inner_loop.rank_task")
    assert upstream(dag, "inner_loop.collect_task") == {f"inner_loop.step_v{MAX_SEARCH_ITERATIONS}", "search_tasks"}
    assert upstream(dag, "inner_loop.rank_task") == {"inner_loop.collect_task", "search_tasks"}
    assert upstream(dag, "select") == {"inner_loop.rank_task"}
    assert not {"collection_units", "ranking_tasks", "collect_candidate"} & set(dag.task_dict), "no barrier task"
    assert type(collect).__name__ == "TaskCollectionOperator" and not collect.is_mapped
    # Versions beyond a run's search.iterations are skipped, and collection must still run.
    assert collect.trigger_rule == TriggerRule.NONE_FAILED
    # A skipped collection (a task searched only, or not collected) skips its ranking; selection still runs.
    assert rank.trigger_rule == TriggerRule.ALL_SUCCESS
    assert dag.get_task("select").trigger_rule == TriggerRule.NONE_FAILED


def test_the_critical_path_goes_first_in_the_pools(dag):
    """Search steps outrank collection and ranking, earlier versions later ones, all with absolute weights."""
    chain = ["inner_loop.reference_episode"]
    chain += [f"inner_loop.step_v{k}" for k in range(MAX_SEARCH_ITERATIONS + 1)]
    chain += ["inner_loop.collect_task", "inner_loop.rank_task"]
    weights = [dag.get_task(task_id).priority_weight for task_id in chain]
    assert weights == sorted(weights, reverse=True) and len(set(weights)) == len(weights), weights
    assert dag.get_task("inner_loop.episode_v0").priority_weight == weights[0]
    for task_id in [*chain, "inner_loop.episode_v0"]:
        assert str(dag.get_task(task_id).weight_rule) in ("absolute", "WeightRule.ABSOLUTE"), task_id
    assert dag.get_task("inner_loop.collect_task").pool_slots == 1


def test_the_pools_weights_are_the_chain_order_the_episode_pool_and_the_server_use(dag):
    """One order of the critical path (`mass_ops.critical_path`): the DAG's weights are its chain priorities + 1 (so
    that ranking, with no chain after it, still has Airflow's minimum weight of 1)."""
    iterations = MAX_SEARCH_ITERATIONS
    assert [dag.get_task(f"inner_loop.step_v{k}").priority_weight for k in range(iterations + 1)] == [
        chain_priority("search", k, iterations) + 1 for k in range(iterations + 1)
    ]
    assert dag.get_task("inner_loop.collect_task").priority_weight == chain_priority("collection", None, iterations) + 1
    assert dag.get_task("inner_loop.rank_task").priority_weight == chain_priority("ranking", None, iterations) + 1


def test_units_have_readable_names(dag):
    searched = ("inner_loop.step_v0", "inner_loop.step_v2", "inner_loop.episode_v0", "inner_loop.reference_episode")
    for task_id in searched:
        task = dag.get_task(task_id)
        assert task.map_index_template in ("{{ unit_label }}", "{{ episode_label }}"), task_id
    for task_id in ("inner_loop.collect_task", "inner_loop.rank_task"):
        assert dag.get_task(task_id).map_index_template == "{{ unit_label }}", task_id
    rollout = dag.get_task("rollout")
    assert rollout.is_mapped and rollout.partial_kwargs["stage"] == "rollout_unit"
    assert rollout.partial_kwargs["map_index_template"] == "{{ episode_label }}"


def test_inference_server_is_a_setup_teardown_pair(dag):
    for setup, teardown in (
        ("inference_up", "inference_down"),
        ("evaluation_inference_up", "evaluation_inference_down"),
    ):
        up, down = dag.get_task(setup), dag.get_task(teardown)
        assert up.is_setup and down.is_teardown
        assert setup in down.upstream_task_ids
        assert down.trigger_rule == TriggerRule.ALL_DONE_SETUP_SUCCESS, "teardown runs even when the work fails"
    # Everything that talks to the model server lies between the pair (cleared together, torn down together).
    for task_id in ("inner_loop.step_v0", "inner_loop.collect_task", "inner_loop.rank_task", "select"):
        assert "inference_up" in dag.get_task(task_id).get_flat_relative_ids(upstream=True)


def test_pools(dag):
    inference = {"inner_loop.reference_episode", "inner_loop.episode_v0", "inner_loop.collect_task", "rollout"}
    inference |= {"inner_loop.rank_task", *(f"inner_loop.step_v{k}" for k in range(MAX_SEARCH_ITERATIONS + 1))}
    gpu = {"inference_up", "evaluation_inference_up", "train", "export"}
    for task in dag.tasks:
        if task.task_id in inference:
            assert task.pool == INFERENCE_POOL, task.task_id
        elif task.task_id in gpu:
            assert task.pool == GPU_POOL, task.task_id
        else:
            assert task.pool == "default_pool", task.task_id


def test_retries_back_off_and_every_task_is_bounded(dag):
    no_retry = {"validate_config", "continue_cycle", "approve_promotion"}  # bad input / a trigger / an answer
    for task in dag.tasks:
        assert task.execution_timeout is not None, task.task_id
        if task.task_id in no_retry:
            assert task.retries == 0, task.task_id
            continue
        assert task.retries >= 1 and task.retry_exponential_backoff >= 2.0, task.task_id
        assert task.max_retry_delay is not None, task.task_id
    assert dag.get_task("train").execution_timeout.total_seconds() >= 19 * 3600  # the paper's cycle 1 took ~19 h


def test_promote_announces_the_generation_through_an_asset_alias(dag):
    """The asset event says "serve this generation": it goes out when the generation is promoted, not registered."""
    (outlet,) = dag.get_task("promote").outlets
    assert type(outlet).__name__ == "AssetAlias" and outlet.name == "mass-ops-generations"
    assert dag.get_task("register").outlets == []


def test_the_promotion_gate_is_airflow_s_approval_skipped_without_require_approval(dag):
    gate = dag.get_task("approve_promotion")
    assert type(gate).__name__ == "ApprovalOperator" and gate.retries == 0
    assert gate.defaults == ["Reject"] and gate.response_timeout is not None, "unanswered: nothing is promoted"
    assert "promotion_request" in gate.body and "promotion_request" in gate.subject, "the evaluation's headline"
    # promotion_request skips itself (and so the gate) without promotion.require_approval; promote still runs.
    assert dag.get_task("promote").trigger_rule == TriggerRule.NONE_FAILED
    assert dag.get_task("continue_cycle").trigger_rule == TriggerRule.ALL_SUCCESS, "rejected: no next cycle"


def test_operators_pick_the_backend_at_run_time(dag):
    kinds = {t.task_id: type(t).__name__ for t in dag.tasks}
    assert kinds["inference_up"] == "InferenceServerOperator"
    assert kinds["inference_down"] == "InferenceServerTeardownOperator"
    assert kinds["train"] == "TrainingJobOperator" and kinds["export"] == "ExportJobOperator"
    assert kinds["inner_loop.episode_v0"] == kinds["inner_loop.reference_episode"] == "EpisodePodOperator"
    assert kinds["inner_loop.step_v3"] == "EpisodeStageOperator"
    assert kinds["inner_loop.collect_task"] == "TaskCollectionOperator"
    assert dag.get_task("rollout").partial_kwargs["kind"] == "rollout"
    assert dag.get_task("evaluation_inference_up").serve == "evaluation"


def test_the_report_step_writes_the_run_s_cycle_report_and_links_it(dag):
    report = dag.get_task("report")
    assert type(report).__name__ == "ReportOperator" and report.stage == "report"
    assert [link.name for link in report.operator_extra_links] == ["Cycle report"]
    assert report.trigger_rule == TriggerRule.ALL_SUCCESS


def test_the_repair_commands_name_tasks_of_this_dag(dag):
    """`mass-ops repair` prints Airflow clear commands by task id; each id must exist here."""
    from mass_ops.ops import repair
    from mass_ops.ops.status import UnitState

    named = {task for tasks in repair.AIRFLOW_TASKS.values() for task in tasks}
    broken = [UnitState("search", f"search-t51-v{k}", "failed", task_id=51) for k in (0, MAX_SEARCH_ITERATIONS)]
    named |= set(repair._search_airflow_tasks(broken))
    assert named - set(dag.task_dict) == set()
    assert dag.dag_id == repair.DAG_ID
