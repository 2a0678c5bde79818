"""The per-task collection unit: the local backend calls the `collect_task` stage; on Kubernetes one sandbox pod per
candidate not recorded yet, at most the endpoint's capacity at once, waited for, deleted, failures with their log
tails, then the stage. Kubernetes is the in-memory stand-in (tests/plugins/kube_fakes.py)."""

from __future__ import annotations

from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowSkipException
from mass_ops_airflow.checks import StageOutputMissing
from mass_ops_airflow.operators import TaskCollectionOperator
from mass_ops_airflow.operators.collection import CollectionPodsFailed

from mass_ops.seeds import collection_seed
from tests.compute.test_kubernetes_specs import flags
from tests.plugins.test_episode_operator import K8S, LOG, retain_v0
from tests.support.airflow import task_context

TASK = 202  # a training task of the paper preset
CANDIDATES = 18  # the paper preset's collection.candidates
CAPACITY = 4  # the paper preset's inference.max_concurrent_requests


@pytest.fixture
def repo(cycle_store, cluster, chart_settings):
    repository = cycle_store(K8S)
    retain_v0(repository, TASK)
    return repository


def collection(**kwargs: Any) -> TaskCollectionOperator:
    return TaskCollectionOperator(task_id="t", task=TASK, poll_interval_s=0, **kwargs)


def record_candidate(repo, candidate: int, status: str = "succeeded", attempt: int = 1) -> None:
    seed = collection_seed(repo.config.collection.seed_base, TASK, candidate)
    repo.record_episode(
        repo.cycle_id, task_id=TASK, kind="collection", candidate=candidate, seed=seed, status=status, attempt=attempt
    )


def candidate_of(manifest: dict[str, Any]) -> int:
    return int(flags(manifest["spec"]["containers"][0]["command"])["--candidate"])


class Pods:
    """What the pods do when created: record their episode (unless told otherwise); the largest number alive."""

    def __init__(self, repo, cluster) -> None:
        self.repo, self.cluster = repo, cluster
        self.created: list[int] = []
        self.most_alive = 0
        self.silent: set[int] = set()  # candidates whose pod exits 0 without recording anything
        cluster.on_pod_created = self.created_pod

    def created_pod(self, manifest: dict[str, Any]) -> None:
        self.most_alive = max(self.most_alive, len(self.cluster.objects["pods"]) + 1)
        candidate = candidate_of(manifest)
        self.created.append(candidate)
        if candidate not in self.silent and self.cluster.pod_outcome[0] == "Succeeded":
            earlier = self.repo.episodes(self.repo.cycle_id, task_id=TASK, kind="collection")
            attempt = 1 + sum(row.candidate == candidate for row in earlier)
            record_candidate(self.repo, candidate, attempt=attempt)


def test_local_backend_calls_the_stage_only(cluster, stages):
    stages.results["collect_task"] = {"task_id": TASK, "decision": "collect", "candidates": 3, "succeeded": 3}
    context = task_context({"preset": "demo"})
    result = collection().execute(context)
    assert result == {"backend": "local", "task": TASK, "result": stages.results["collect_task"]}
    ((name, args),) = stages.calls
    assert (name, args[1:]) == ("collect_task", (TASK,))
    assert context["unit_label"] == f"collection-t{TASK} (3 candidates)"
    assert cluster.calls == []


def test_a_failed_stage_fails_the_unit(cluster, stages):
    """`CollectionIncompleteError` (some candidates failed on infrastructure) propagates: ranking waits."""
    from mass_ops.errors import InfrastructureError

    def incomplete(config, task):
        raise InfrastructureError(f"task {task}: 1 of 3 teacher candidates failed on infrastructure")

    stages.results["collect_task"] = incomplete
    with pytest.raises(InfrastructureError, match="1 of 3 teacher candidates"):
        collection().execute(task_context({"preset": "demo"}))


def test_a_task_searched_only_is_skipped_before_anything_runs(cluster, stages):
    operator = TaskCollectionOperator(task_id="t", task=221, poll_interval_s=0)  # searched, not trained (paper)
    with pytest.raises(AirflowSkipException, match=r"task 221 is searched only \(not in tasks\.train\)"):
        operator.execute(task_context(K8S))
    assert stages.calls == [] and cluster.calls == []


def test_one_pod_per_unrecorded_candidate_at_most_the_capacity_at_once_then_the_stage(repo, cluster, stages):
    pods = Pods(repo, cluster)
    for done in (0, 5):  # recorded by an earlier try: reused, no pod
        record_candidate(repo, done)
    record_candidate(repo, 7, status="infra_failure")  # not final: its pod runs again
    result = collection().execute(task_context(K8S))
    assert sorted(pods.created) == [c for c in range(CANDIDATES) if c not in (0, 5)]
    assert 1 < pods.most_alive <= CAPACITY, "at most inference.max_concurrent_requests pods at once"
    assert not cluster.objects["pods"], "every pod is deleted once it ended"
    assert cluster.calls.count(("", "pods", "delete")) == CANDIDATES - 2
    assert result["backend"] == "kubernetes" and stages.names() == ["collect_task"]
    assert stages.calls[0][1][1:] == (TASK,)


def test_each_pod_is_leased_as_it_is_created(repo, cluster, stages):
    """From its pod's creation until its row, a candidate's lease (its next attempt, on the pod) makes `status`
    count it in flight."""
    record_candidate(repo, 3, status="infra_failure")  # its pod runs attempt 2
    seen: dict[int, tuple[list[tuple[int, str | None]], str]] = {}

    def created(manifest: dict[str, Any]) -> None:
        candidate = candidate_of(manifest)
        seed = collection_seed(repo.config.collection.seed_base, TASK, candidate)
        leases = repo.episode_leases(repo.cycle_id)
        mine = [
            (lease.attempt, lease.host)
            for lease in leases
            if lease.unit_key == f"collection-t{TASK}-c{candidate}-s{seed}"
        ]
        seen[candidate] = (mine, manifest["metadata"]["name"])
        earlier = repo.episodes(repo.cycle_id, task_id=TASK, kind="collection")
        record_candidate(repo, candidate, attempt=1 + sum(row.candidate == candidate for row in earlier))

    cluster.on_pod_created = created
    collection().execute(task_context(K8S))
    assert sorted(seen) == list(range(CANDIDATES))
    for candidate, (leases, pod) in seen.items():
        assert leases == [(2 if candidate == 3 else 1, pod)], candidate


def test_the_pods_run_the_requests_the_stage_runs(repo, cluster, stages):
    from mass_ops.context import attach_cycle
    from mass_ops.stages.collect import collection_requests, freeze_teacher_prompt

    manifests: list[dict[str, Any]] = []
    cluster.on_pod_created = lambda manifest: (
        manifests.append(manifest),
        record_candidate(repo, candidate_of(manifest)),
    )
    collection().execute(task_context(K8S))
    ctx = attach_cycle(repo.config)
    expected = collection_requests(ctx, TASK, freeze_teacher_prompt(ctx, TASK, 0))
    for manifest in manifests:
        run = flags(manifest["spec"]["containers"][0]["command"])
        request = expected[int(run["--candidate"])]
        assert (run["--kind"], int(run["--task"]), int(run["--seed"])) == ("collection", TASK, request.unit.seed)
        assert run["--condition"] == request.condition
        assert manifest["metadata"]["labels"]["mass-ops/role"] == "episode"
    assert len(manifests) == CANDIDATES


def test_everything_recorded_launches_nothing(repo, cluster, stages):
    for candidate in range(CANDIDATES):
        record_candidate(repo, candidate)
    collection().execute(task_context(K8S))
    assert ("", "pods", "create") not in cluster.calls and stages.names() == ["collect_task"]


def test_failed_pods_fail_the_unit_with_their_log_tails_and_the_stage_does_not_run(repo, cluster, stages):
    cluster.pod_outcome = ("Failed", 3)
    cluster.default_log = LOG
    for candidate in range(CANDIDATES - 2):
        record_candidate(repo, candidate)
    with pytest.raises(CollectionPodsFailed) as caught:
        collection().execute(task_context(K8S))
    message = str(caught.value)
    assert message.startswith(f"task {TASK}: 2 of 2 candidate pod(s) failed")
    assert f"candidate collection-t{TASK}-c16:" in message and f"candidate collection-t{TASK}-c17:" in message
    assert "container base:" in message and "container publisher:" in message
    assert "agent line 99" in message and "agent line 60" in message and "agent line 59" not in message
    assert not cluster.objects["pods"] and stages.calls == []
    assert repo.episode_leases(repo.cycle_id) == [], "the failed pods' leases are ended: nothing runs any more"


def test_a_pod_that_cannot_start_fails_fast(repo, cluster, stages):
    cluster.pod_outcome = ("Pending", None)
    for candidate in range(CANDIDATES - 1):
        record_candidate(repo, candidate)

    def image_missing(manifest: dict[str, Any]) -> None:
        waiting = {"reason": "ImagePullBackOff", "message": "pull access denied"}
        manifest["status"]["containerStatuses"] = [
            {
                "name": "base",
                "ready": False,
                "restartCount": 0,
                "image": "i",
                "imageID": "",
                "state": {"waiting": waiting},
            }
        ]

    cluster.on_pod_created = image_missing
    with pytest.raises(CollectionPodsFailed, match="container base is ImagePullBackOff: pull access denied"):
        collection().execute(task_context(K8S))
    assert repo.episode_leases(repo.cycle_id) == [], "a pod that never started leaves no unit in flight"
    assert not cluster.objects["pods"] and stages.calls == []


def test_exit_zero_without_the_episode_recorded_fails_the_post_check(repo, cluster, stages):
    pods = Pods(repo, cluster)
    pods.silent = {3}
    with pytest.raises(StageOutputMissing, match=f"no final episode recorded: collection-t{TASK}-c3$"):
        collection().execute(task_context(K8S))
    assert stages.calls == []


def test_a_kill_while_waiting_deletes_every_pod(repo, cluster, stages):
    cluster.pod_outcome = ("Running", None)
    operator = collection()
    seen: list[int] = []

    def killed_while_waiting() -> None:
        seen.append(len(cluster.objects["pods"]))
        operator.on_kill()
        raise KeyboardInterrupt("the task was killed")

    operator._sleep = killed_while_waiting  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        operator.execute(task_context(K8S))
    assert seen == [CAPACITY]
    assert not cluster.objects["pods"] and stages.calls == []
    assert repo.episode_leases(repo.cycle_id) == [], "the deleted pods' leases are ended"


def test_a_retry_reattaches_to_a_pod_still_running(repo, cluster, stages):
    pods = Pods(repo, cluster)
    for candidate in range(1, CANDIDATES):
        record_candidate(repo, candidate)
    operator = collection()
    cluster.pod_outcome = ("Running", None)
    first: list[str] = []

    def interrupted() -> None:
        first.extend(cluster.objects["pods"])
        raise TimeoutError("the first try timed out")

    operator._sleep = interrupted  # type: ignore[method-assign]
    with pytest.raises(TimeoutError):
        operator.execute(task_context(K8S))
    ((name,),) = [first]
    # The first try's pod is still there (say its deletion never reached the API): the retry waits for it.
    cluster.objects["pods"][name] = {
        "metadata": {"name": name, "namespace": "mass-ops", "labels": {}},
        "spec": {"containers": [{"name": "base", "image": "i"}]},
        "status": {"phase": "Running"},
    }
    retry = collection()

    def finishes() -> None:
        cluster.objects["pods"][name]["status"] = {"phase": "Succeeded"}
        record_candidate(repo, 0)

    retry._sleep = finishes  # type: ignore[method-assign]
    retry.execute(task_context(K8S))
    assert pods.created == [0], "the retry created no second pod"
    assert not cluster.objects["pods"] and stages.names() == ["collect_task"]


def test_a_task_not_collected_launches_nothing_and_is_skipped(cycle_store, cluster, chart_settings, stages):
    """Its retained workflow never beat the reference: no request exists for its candidates; the stage records the
    decision and the unit is skipped with its reason."""
    repository = cycle_store(K8S)
    repository.record_workflow_version(repository.cycle_id, TASK, 0, design="design v0")
    repository.record_retained_workflow(
        repository.cycle_id, TASK, version=0, beats_reference=False, last_evaluated_version=0
    )
    reason = "no workflow version beat the reference; task skipped (collection.require_beats_reference)"
    stages.results["collect_task"] = {"task_id": TASK, "decision": "skip", "reason": reason}
    with pytest.raises(AirflowSkipException, match=f"task {TASK}: no workflow version beat the reference"):
        collection().execute(task_context(K8S))
    assert ("", "pods", "create") not in cluster.calls and stages.names() == ["collect_task"]


def test_a_spent_task_budget_starts_no_further_pod_and_the_raised_budget_continues(repo, cluster, stages):
    """Each pod's spend reaches the ledger when its episode is ingested (here: as the pod is created); once the task's
    budget is spent, no further pod starts, the running ones finish, and the unit fails without retry. Raising the
    budget and clearing the unit runs only what is missing."""
    from airflow.sdk.exceptions import AirflowFailException

    from tests.plugins.test_episode_operator import budgets

    pods = Pods(repo, cluster)
    record = pods.created_pod

    def charged(manifest: dict[str, Any]) -> None:
        record(manifest)
        repo.add_budget_spend(repo.cycle_id, [f"task:{TASK}", "cycle"], tokens=400)

    cluster.on_pod_created = charged
    with pytest.raises(
        AirflowFailException,
        match=rf"task {TASK}: candidate collection-t{TASK}-c{CAPACITY}\S*: no pod created: budget exhausted: "
        rf"task {TASK} has used 1,600",
    ):
        collection().execute(task_context(budgets(task_tokens=1_000, episode_tokens=400)))
    first_wave = sorted(pods.created)
    assert first_wave == list(range(CAPACITY)), "the pods admitted before any spend was charged ran to their end"
    assert not cluster.objects["pods"] and stages.names() == [], "nothing left running; the stage did not run"
    stopped = [
        e for e in repo.episodes(repo.cycle_id, task_id=TASK, kind="collection") if e.status == "budget_exhausted"
    ]
    assert [(e.candidate, e.failure["not_started"]) for e in stopped] == [(CAPACITY, True)]

    collection().execute(task_context(budgets(task_tokens=100_000, episode_tokens=400)))
    assert sorted(pods.created[len(first_wave) :]) == list(range(CAPACITY, CANDIDATES)), "only what was missing ran"
    assert stages.names() == ["collect_task"]
