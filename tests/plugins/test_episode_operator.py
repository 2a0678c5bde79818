"""The episode operator, tested the way the provider tests its pod operator: the pod manager's waits patched, the
Kubernetes API faked, everything else (pod building, reattach, cleanup, failure handling) the provider's own code.

Before its pod, the operator computes the request the unit's stage runs, so the cycle holds what those stages would
have recorded by then: search v3 proposed (for the search episodes), task 202's retained workflow (for collection)."""

from __future__ import annotations

import hashlib
from typing import Any
from unittest import mock

import pytest
from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger
from airflow.providers.cncf.kubernetes.utils.pod_manager import PodManager
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException, TaskDeferred
from mass_ops_airflow.checks import StageOutputMissing
from mass_ops_airflow.operators import EpisodePodOperator, EpisodeStageOperator
from mass_ops_airflow.operators._pod import SandboxPodFailed

from mass_ops.compute import kubernetes as specs
from mass_ops.layout import workflow_version_key
from mass_ops.stages.units import EpisodeUnitError
from tests.support.airflow import task_context

K8S = {"preset": "paper", "compute_backend": "kubernetes", "overrides": ['tasks.catalogue="builtin"']}


def budgets(**limits: int) -> dict[str, Any]:
    """The K8S params with budget limits (not part of the config hash: the same cycle, other budgets)."""
    return {**K8S, "overrides": [*K8S["overrides"], *(f"budgets.{name}={value}" for name, value in limits.items())]}


def propose(repo, task: int, version: int) -> str:
    """Record workflow version `version` of `task` as step version-1 does (prompt stored, row with its hash)."""
    from mass_ops.context import attach_cycle

    ctx = attach_cycle(repo.config)
    prompt = ctx.catalogue.task(task).initial_prompt + f"\n(revised design v{version})\n"
    ctx.artifacts.put_bytes(workflow_version_key(ctx.cycle_name, task, version), prompt.encode())
    sha = hashlib.sha256(prompt.encode()).hexdigest()
    repo.record_workflow_version(repo.cycle_id, task, version, design=f"design v{version}", prompt_sha256=sha)
    return prompt


def retain_v0(repo, task: int) -> None:
    """Record that `task`'s search retained v0 (and that v0 beat the reference): its teacher candidates collect."""
    repo.record_workflow_version(repo.cycle_id, task, 0, design="design v0")
    repo.record_retained_workflow(repo.cycle_id, task, version=0, beats_reference=True, last_evaluated_version=0)


@pytest.fixture
def repo(cycle_store, cluster, chart_settings):
    repository = cycle_store(K8S)
    propose(repository, 51, 3)
    retain_v0(repository, 202)
    return repository


def created_pods(cluster) -> list[dict[str, Any]]:
    """Record the manifest of every pod the operator creates."""
    pods: list[dict[str, Any]] = []
    previous = cluster.on_pod_created

    def created(manifest: dict[str, Any]) -> None:
        pods.append(manifest)
        if previous is not None:
            previous(manifest)

    cluster.on_pod_created = created
    return pods


LOG = "\n".join(f"agent line {i}" for i in range(100))


@pytest.fixture
def pod_waits():
    """Patch the pod manager's waits (start, log following) as the provider's own operator tests do."""
    with (
        mock.patch.object(PodManager, "await_pod_start", new_callable=mock.AsyncMock) as start,
        mock.patch.object(PodManager, "fetch_requested_container_logs") as logs,
    ):
        yield start, logs


def search_episode(**kwargs) -> EpisodePodOperator:
    return EpisodePodOperator(task_id="t", kind="search", task=51, version=3, deferrable=False, **kwargs)


def record_episode(repo, status: str = "succeeded") -> int:
    episode = repo.record_episode(repo.cycle_id, task_id=51, kind="search", version=3, seed=453051, status=status)
    return episode.id


def pod_records_its_episode(repo, cluster) -> None:
    """The pod's `mass-ops episode run` records the episode (what the post-check then finds)."""
    cluster.on_pod_created = lambda manifest: record_episode(repo)


def test_success_runs_the_sandbox_pod_and_checks_the_store(repo, cluster, pod_waits):
    pod_records_its_episode(repo, cluster)
    result = search_episode().execute(task_context(K8S))
    assert result == {
        "backend": "kubernetes", "episode": "search-t51-v3", "episode_id": 1, "status": "succeeded", "attempt": 1,
    }  # fmt: skip
    created = [c for c in cluster.calls if c == ("", "pods", "create")]
    assert len(created) == 1 and not cluster.objects["pods"], "the pod is deleted once it finished"
    start, _ = pod_waits
    pod = start.call_args.kwargs["pod"]
    labels = pod.metadata.labels
    assert labels["mass-ops/role"] == "episode" and labels["app.kubernetes.io/component"] == "episode"
    assert labels["dag_id"] == "mass_cycle" and labels["kubernetes_pod_operator"] == "True"
    assert pod.spec.automount_service_account_token is False
    assert pod.spec.containers[0].security_context.run_as_non_root is True
    assert pod.spec.containers[0].command[:3] == ["mass-ops", "episode", "run"]
    assert pod.spec.containers[1].command[:3] == ["mass-ops", "episode", "publish"]
    assert start.call_args.kwargs["startup_timeout"] == start.call_args.kwargs["schedule_timeout"] == 1800


def test_the_pod_is_leased_as_it_is_created_so_status_shows_the_unit_running(repo, cluster, pod_waits):
    """An episode's row comes when its attempt ends: from its pod's creation until then the unit's lease (the next
    attempt after the recorded ones, on the pod) makes `status` count it in flight."""
    from mass_ops.ops.status import cycle_status

    record_episode(repo, status="infra_failure")  # attempt 1 failed: the pod runs attempt 2
    seen: list[Any] = []

    def created(manifest: dict[str, Any]) -> None:
        seen.append(manifest["metadata"]["name"])
        seen.append([(lease.unit_key, lease.attempt, lease.host) for lease in repo.episode_leases(repo.cycle_id)])
        status = cycle_status(repo.config, repo.config.cycle_name)
        seen.append(next((u.state, u.detail) for u in status.units if u.key == "search-t51-v3"))
        repo.record_episode(repo.cycle_id, task_id=51, kind="search", version=3, seed=453051, status="succeeded",
                            attempt=2)  # fmt: skip

    cluster.on_pod_created = created
    result = search_episode().execute(task_context(K8S))
    assert (result["status"], result["attempt"]) == ("succeeded", 2)
    (pod, [(key, attempt, where)], (state, detail)) = seen
    assert (key, attempt) == ("search-t51-v3-s453051", 2)
    assert pod.startswith(f"{where}-"), "the pod's name before the provider's random suffix"
    assert state == "running" and detail.startswith("attempt 2 started ") and detail.endswith(f" ago on {where}")


def test_exit_zero_without_a_recorded_episode_fails(repo, cluster, pod_waits):
    with pytest.raises(StageOutputMissing, match="search-t51-v3: the pod exited 0 but the metadata store has no row"):
        search_episode().execute(task_context(K8S))


def test_only_infrastructure_failures_recorded_fails(repo, cluster, pod_waits):
    record_episode(repo, status="infra_failure")  # an earlier attempt; the pod records nothing new
    with pytest.raises(StageOutputMissing, match="recorded as infra_failure"):
        search_episode().execute(task_context(K8S))


def test_pod_failure_fails_the_task_with_the_log_tail(repo, cluster, pod_waits):
    cluster.pod_outcome = ("Failed", 3)
    cluster.default_log = LOG
    with pytest.raises(SandboxPodFailed) as caught:
        search_episode().execute(task_context(K8S))
    message = str(caught.value)
    assert "returned a failure" in message and "last 40 lines of the pod's log" in message
    assert "agent line 99" in message and "agent line 60" in message and "agent line 59" not in message
    # Both containers' tails: the sandbox's, and the publisher's (a failed publish fails the pod too).
    assert "container base:" in message and "container publisher:" in message
    assert cluster.calls.count(("", "pods/log", "get")) >= 2
    assert ("", "pods", "patch") in cluster.calls, "a failed pod is marked checked so a retry never re-attaches"
    assert not cluster.objects["pods"], "and then deleted"
    assert repo.episode_leases(repo.cycle_id) == [], "no publisher will end the failed pod's lease: the operator did"


def test_deferred_wait_and_failure_on_reentry(repo, cluster, pod_waits):
    operator = EpisodePodOperator(task_id="t", kind="collection", task=202, candidate=4)
    context = task_context(K8S)
    with pytest.raises(TaskDeferred) as caught:
        operator.execute(context)
    trigger = caught.value.trigger
    assert isinstance(trigger, KubernetesPodTrigger) and caught.value.method_name == "trigger_reentry"
    assert trigger.schedule_timeout == 1800
    (pod_name,) = cluster.objects["pods"]
    assert trigger.pod_name == pod_name
    cluster.objects["pods"][pod_name]["status"] = cluster._pod_status(cluster.objects["pods"][pod_name]) | {
        "phase": "Failed"
    }
    cluster.logs[pod_name] = "uv sync\nerror: no space left on device"
    event = {"status": "failed", "name": pod_name, "namespace": "mass-ops", "message": "Container failed"}
    with pytest.raises(SandboxPodFailed, match="no space left on device"):
        EpisodePodOperator(task_id="t", kind="collection", task=202, candidate=4).trigger_reentry(context, event)
    assert not cluster.objects["pods"]


def test_kill_deletes_the_pod(repo, cluster, pod_waits):
    operator = EpisodePodOperator(task_id="t", kind="reference", task=51)
    with pytest.raises(TaskDeferred):
        operator.execute(task_context(K8S))
    assert len(cluster.objects["pods"]) == 1
    assert len(repo.episode_leases(repo.cycle_id)) == 1, "a deferred wait is not a failure: the pod runs, leased"
    operator.on_kill()
    assert not cluster.objects["pods"]
    assert repo.episode_leases(repo.cycle_id) == [], "the deleted pod's lease is ended"


def test_retry_reattaches_to_the_running_pod(repo, cluster, pod_waits):
    running = {
        "metadata": {
            "name": "ep-left-over",
            "namespace": "mass-ops",
            "labels": {"dag_id": "mass_cycle", "task_id": "t", "run_id": "manual__1", "kubernetes_pod_operator": "True",
                       "try_number": "1"},
        },
        "spec": {"containers": [{"name": "base", "image": "i"}]},
        "status": {"phase": "Running"},
    }  # fmt: skip
    cluster.objects["pods"]["ep-left-over"] = running
    operator = EpisodePodOperator(task_id="t", kind="reference", task=51)
    with pytest.raises(TaskDeferred) as caught:
        operator.execute(task_context(K8S))
    assert caught.value.trigger.pod_name == "ep-left-over"
    assert ("", "pods", "create") not in cluster.calls


def test_local_backend_launches_nothing(cluster):
    result = EpisodePodOperator(task_id="t", kind="search", task=51, version=1).execute(
        task_context({"preset": "demo"})
    )
    assert result == {"backend": "local", "episode": "search-t51-v1"}
    assert cluster.calls == []


def test_versions_beyond_the_search_budget_are_skipped(cluster):
    operator = EpisodePodOperator(task_id="t", kind="search", task=51, version=2)
    with pytest.raises(AirflowSkipException, match=r"search\.iterations is 1: no version 2"):
        operator.execute(task_context({"preset": "demo", "compute_backend": "kubernetes"}))
    assert cluster.calls == []


# --- episode + stage in one task ------------------------------------------------------------------------------


def test_stage_operator_runs_the_pod_then_the_stage(repo, cluster, pod_waits, stages):
    pod_records_its_episode(repo, cluster)
    stages.results["search_step"] = {"task_id": 51, "version": 3, "champion": 2}
    operator = EpisodeStageOperator(task_id="t", kind="search", task=51, version=3, stage="search_step")
    operator.deferrable = False
    result = operator.execute(task_context(K8S))
    assert result == {"backend": "kubernetes", "episode": "search-t51-v3", "result": stages.results["search_step"]}
    assert [c for c in cluster.calls if c == ("", "pods", "create")] == [("", "pods", "create")]
    ((name, args),) = stages.calls
    assert name == "search_step" and args[1:] == (51, 3) and args[0].compute.backend == "kubernetes"


def test_stage_operator_skips_the_pod_of_a_recorded_episode(repo, cluster, stages):
    record_episode(repo)
    result = EpisodeStageOperator(task_id="t", kind="search", task=51, version=3, stage="search_step").execute(
        task_context(K8S)
    )
    assert result["backend"] == "kubernetes" and stages.names() == ["search_step"]
    assert ("", "pods", "create") not in cluster.calls, "a cleared or retried task redoes only what is missing"


def test_stage_operator_does_not_run_the_stage_after_a_failed_pod(repo, cluster, pod_waits, stages):
    cluster.pod_outcome = ("Failed", 2)
    operator = EpisodeStageOperator(task_id="t", kind="collection", task=202, candidate=1, stage="collect_candidate")
    operator.deferrable = False
    with pytest.raises(SandboxPodFailed):
        operator.execute(task_context(K8S))
    assert stages.calls == []


@pytest.mark.parametrize(
    ("kwargs", "stage", "arguments"),
    [
        ({"kind": "search", "task": 51, "version": 1}, "search_step", (51, 1)),
        ({"kind": "collection", "task": "202", "candidate": "2"}, "collect_candidate", (202, 2)),
        ({"kind": "rollout", "task": 60, "replicate": 0, "generation": "L1"}, "rollout", ("L1", 60, 0)),
    ],
)
def test_stage_operator_on_the_local_backend_only_calls_the_stage(cluster, stages, kwargs, stage, arguments):
    result = EpisodeStageOperator(task_id="t", stage=stage, **kwargs).execute(task_context({"preset": "demo"}))
    assert result["backend"] == "local"
    ((name, args),) = stages.calls
    assert (name, args[1:]) == (stage, arguments)
    assert cluster.calls == []


# --- what the pod runs ------------------------------------------------------------------------------------------


def stage_request(config, kwargs: dict[str, Any]) -> Any:
    """The request the unit's stage builds, from the stage modules' own builders (not through the operator)."""
    from mass_ops.context import attach_cycle
    from mass_ops.evaluation.rollouts import rollout_requests
    from mass_ops.search.driver import reference_request, version_request
    from mass_ops.stages.collect import collection_requests, freeze_teacher_prompt

    ctx = attach_cycle(config)
    task = int(kwargs["task"])
    if kwargs["kind"] == "reference":
        return reference_request(ctx, task)
    if kwargs["kind"] == "search":
        prompt = ctx.artifacts.get_bytes(workflow_version_key(ctx.cycle_name, task, kwargs["version"])).decode()
        return version_request(ctx, task, kwargs["version"], prompt)
    if kwargs["kind"] == "collection":
        return collection_requests(ctx, task, freeze_teacher_prompt(ctx, task, 0))[kwargs["candidate"]]
    (request,) = [
        r for r in rollout_requests(ctx, kwargs["generation"], [task]) if r.unit.candidate == kwargs["replicate"]
    ]
    return request


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "reference", "task": 51},
        {"kind": "search", "task": 51, "version": 3},
        {"kind": "collection", "task": 202, "candidate": 4},
        {"kind": "rollout", "task": 60, "replicate": 2, "generation": "L1"},
    ],
    ids=lambda kwargs: kwargs["kind"],
)
def test_the_pod_runs_the_request_its_stage_runs(repo, cluster, pod_waits, kwargs):
    from mass_ops.context import attach_cycle
    from tests.compute.test_kubernetes_specs import flags

    pods = created_pods(cluster)
    EpisodePodOperator(task_id="t", deferrable=False, check_outputs=False, **kwargs).execute(task_context(K8S))
    ((manifest,),) = [pods]
    sandbox, publisher = manifest["spec"]["containers"]
    run, publish = flags(sandbox["command"]), flags(publisher["command"])
    expected = stage_request(repo.config, kwargs)
    unit = expected.unit
    assert (run["--kind"], int(run["--task"]), int(run["--seed"]), run["--condition"]) == (
        unit.kind, unit.task_id, unit.seed, expected.condition,
    )  # fmt: skip
    assert run.get("--version") == (None if unit.version is None else str(unit.version))
    assert run.get("--candidate") == (None if unit.candidate is None else str(unit.candidate))
    assert run.get("--generation") == unit.generation
    assert run["--prompt-file"] == f"{specs.HANDOFF_MOUNT}/prompt.txt"
    # The publisher fetches exactly the stage's prompt: the artifact at the URI it gets holds it, under its hash.
    artifacts = attach_cycle(repo.config).artifacts
    key = publish["--prompt-uri"].removeprefix(artifacts.url.rstrip("/") + "/")
    assert artifacts.uri(key) == publish["--prompt-uri"] and key.endswith(f"/prompts/{expected.prompt_sha256}.txt")
    assert artifacts.get_bytes(key).decode() == expected.prompt
    assert publish["--prompt-sha256"] == expected.prompt_sha256


def test_a_unit_whose_prompt_is_not_known_yet_fails_before_any_pod(repo, cluster, pod_waits, stages):
    operator = EpisodeStageOperator(task_id="t", kind="search", task=51, version=4, stage="search_step")
    operator.deferrable = False
    with pytest.raises(EpisodeUnitError) as caught:
        operator.execute(task_context(K8S))
    expected = "search episode t51 v4: task 51: workflow version v4 does not exist yet; run step 3 first"
    assert str(caught.value) == expected
    assert ("", "pods", "create") not in cluster.calls and stages.calls == []


# --- budgets: admission before the pod, a budget-stopped pod, a budget-stopped stage -------------------------------


def test_no_pod_when_the_task_budget_is_spent_and_the_raised_budget_launches_it(repo, cluster, pod_waits):
    repo.add_budget_spend(repo.cycle_id, ["task:51", "cycle"], tokens=1_000)
    spent = budgets(task_tokens=1_000, episode_tokens=500)
    for _ in range(2):  # a retried or cleared task stops the same way, with no second attempt recorded
        with pytest.raises(AirflowFailException) as caught:
            search_episode().execute(task_context(spent))
        assert str(caught.value) == (
            "episode search-t51-v3: no pod created: budget exhausted: task 51 has used 1,000 of budgets.task_tokens "
            "= 1,000 tokens and the next request needs up to 1; raise budgets.task_tokens in the config and rerun "
            "(finished units are reused)"
        )
    assert ("", "pods", "create") not in cluster.calls
    (stopped,) = repo.episodes(repo.cycle_id)
    assert (stopped.kind, stopped.version, stopped.status, stopped.attempt) == ("search", 3, "budget_exhausted", 1)
    assert stopped.failure["not_started"] is True and stopped.failure["budget"]["scope"] == "task:51"

    # Raised: the pod runs the unit as its next attempt, linked to the stop.
    cluster.on_pod_created = lambda manifest: repo.record_episode(
        repo.cycle_id, task_id=51, kind="search", version=3, seed=453051, status="succeeded", attempt=2,
        retry_of_id=stopped.id,
    )  # fmt: skip
    result = search_episode().execute(task_context(budgets(task_tokens=5_000, episode_tokens=500)))
    assert (result["status"], result["attempt"]) == ("succeeded", 2)
    assert [c for c in cluster.calls if c == ("", "pods", "create")] == [("", "pods", "create")]


def test_a_cycle_budget_spent_by_another_task_stops_this_tasks_pod(repo, cluster, pod_waits, stages):
    repo.add_budget_spend(repo.cycle_id, ["task:51", "cycle"], tokens=2_000)  # task 51's pods, charged at ingest
    operator = EpisodeStageOperator(task_id="t", kind="collection", task=202, candidate=1, stage="collect_candidate")
    operator.deferrable = False
    with pytest.raises(AirflowFailException, match=r"no pod created: budget exhausted: the cycle has used 2,000 of "
                                                   r"budgets\.cycle_tokens = 2,000 tokens"):  # fmt: skip
        operator.execute(task_context(budgets(cycle_tokens=2_000, task_tokens=5_000)))
    assert ("", "pods", "create") not in cluster.calls and stages.calls == [], "no pod, no stage"
    (stopped,) = repo.episodes(repo.cycle_id)
    assert (stopped.kind, stopped.task_id, stopped.candidate, stopped.status) == ("collection", "202", 1,
                                                                                  "budget_exhausted")  # fmt: skip


def test_a_pod_whose_episode_budget_stopped_it_fails_without_retry(repo, cluster, pod_waits, stages):
    message = "budget exhausted: episode has used 480 of budgets.episode_tokens = 500 tokens and the next request"
    cluster.on_pod_created = lambda manifest: repo.record_episode(
        repo.cycle_id, task_id=51, kind="search", version=3, seed=453051, status="budget_exhausted",
        failure={"subtype": "budget_exhausted", "message": message},
    )  # fmt: skip
    operator = EpisodeStageOperator(task_id="t", kind="search", task=51, version=3, stage="search_step")
    operator.deferrable = False
    with pytest.raises(AirflowFailException) as caught:
        operator.execute(task_context(budgets(episode_tokens=500)))
    assert str(caught.value) == f"episode search-t51-v3: attempt 1 is budget_exhausted: {message}"
    assert stages.calls == [], "the stage would only start the episode again"


def test_a_local_stage_stopped_by_a_budget_fails_without_retry(cluster, stages):
    from mass_ops.store.budgets import BudgetExhaustedError, Refusal

    refusal = Refusal("task:51", "budgets.task_tokens", 1_000, 990, 300, "tokens")

    def stopped(config, *args):
        raise BudgetExhaustedError(refusal, "episode collection-t51-c0 not started")

    stages.results["collect_candidate"] = stopped
    operator = EpisodeStageOperator(task_id="t", kind="collection", task=51, candidate=0, stage="collect_candidate")
    with pytest.raises(AirflowFailException) as caught:
        operator.execute(task_context({"preset": "demo"}))
    assert str(caught.value) == f"episode collection-t51-c0: {refusal.message} (episode collection-t51-c0 not started)"
    stages.results["collect_candidate"] = lambda config, *args: 1 / 0
    with pytest.raises(ZeroDivisionError):  # any other error is left to Airflow's retries
        operator.execute(task_context({"preset": "demo"}))
