"""The benchmark trial operator on Kubernetes: per instance, the grader Job from the benchmark's image is created,
waited for in the triggerer, its result read back from the grader's log and recorded; a failed Job fails the task
with the pod's log tails; a retry records a finished Job's result once and never grades an instance twice. Before
that, an instance whose episode is not recorded gets its own episode sandbox pod (the stage's bound request, the
task's time limit, the generation's server), and a retry never relaunches a recorded episode. On the local backend
the trial is the in-process stage."""

from __future__ import annotations

from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred
from mass_ops_airflow.operators.benchmark import BenchmarkTrialOperator, GraderJobFailed
from mass_ops_airflow.triggers import JobCompletionTrigger

from mass_ops.compute.kubernetes import GRADER_CONTAINER, JOB_NAME_LABEL, episode_deadline_s
from mass_ops.evaluation.benchmarks.grading import RESULT_BEGIN, RESULT_END
from tests.support.airflow import task_context

K8S = {"preset": "paper", "compute_backend": "kubernetes", "generation": "L1", "limit": 2, "data_dir": "/data"}
LOCAL = {**K8S, "compute_backend": "local"}
IMAGE = "registry.local/tb2/hello:1"
BUNDLE_SHA = "cd" * 32


class FakeBenchmarkStages:
    """The benchmark stages as the operator sees them: instance `tb2_a` needs a grader Job, `tb2_b` is scored
    without one; a grader result is recorded once per instance."""

    def __init__(self, stages) -> None:
        self.stages = stages
        self.recorded: dict[str, float] = {"tb2_b": 1.0}
        stages.results.update(
            {
                "benchmark_trial_tasks": {"tasks": ["tb2_a", "tb2_b"], "needs_container": True, "evaluator": "v"},
                "benchmark_instance": self.instance,
                "benchmark_grader_result": self.grader_result,
                "benchmark_trial_record": lambda config, *a: {"mean": sum(self.recorded.values()) / 2},
                "benchmark_trial": {"benchmark": "tb2", "mean": 0.5},
            }
        )

    def instance(self, config, benchmark, generation, trial, task, data_dir, episode_pod):
        assert episode_pod is True, "on Kubernetes no episode runs in the operator's task"
        if task in self.recorded:
            return {"status": "recorded", "task": task, "score": self.recorded[task]}
        job = {"benchmark": benchmark, "instance": "a", "image": IMAGE, "script": "bash /tests/test.sh",
               "timeout_s": 900.0, "cpus": None, "memory": None}  # fmt: skip
        return {"status": "grade", "task": task, "job": job, "bundle_uri": "s3://b/x.tar", "bundle_sha256": BUNDLE_SHA}

    def grader_result(self, config, benchmark, generation, trial, task, log, data_dir):
        assert task not in self.recorded, "an instance's result is recorded once"
        self.recorded[task] = float(log.split(RESULT_BEGIN)[1].split(RESULT_END)[0].strip())
        return {"task": task, "score": self.recorded[task], "evaluator": "v"}

    def calls(self, name: str) -> list[tuple]:
        return [args for called, args in self.stages.calls if called == name]


@pytest.fixture
def bench(stages, cycle_store, cluster, chart_settings) -> FakeBenchmarkStages:
    cycle_store({k: v for k, v in K8S.items() if k not in ("generation", "limit", "data_dir")})
    return FakeBenchmarkStages(stages)


def operator() -> BenchmarkTrialOperator:
    return BenchmarkTrialOperator(task_id="benchmark_trial", unit=["tb2", 1], poll_interval_s=1.0)


def defer(op: BenchmarkTrialOperator) -> TaskDeferred:
    with pytest.raises(TaskDeferred) as caught:
        op.execute(task_context(K8S))
    return caught.value


def grader_pod(cluster, job: str, log: str, phase: str = "Succeeded") -> str:
    """What the Job controller would create: one pod labelled with the Job's name, and its log."""
    name = f"{job}-x7k2p"
    cluster.objects["pods"][name] = {
        "metadata": {"name": name, "labels": {JOB_NAME_LABEL: job}, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"containers": [{"name": GRADER_CONTAINER, "image": IMAGE}]},
        "status": {"phase": phase},
    }
    cluster.logs[name] = log
    return name


def test_a_grader_job_is_created_waited_for_and_its_result_recorded(bench, cluster):
    op = operator()
    deferral = defer(op)
    assert isinstance(deferral.trigger, JobCompletionTrigger) and deferral.method_name == "execute_complete"
    assert deferral.kwargs == {"index": 0}
    name = deferral.trigger.job_name
    job = cluster.objects["jobs"][name]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE
    assert job["metadata"]["labels"]["mass-ops/unit"] == "L1-t1" and "l1-t1" in name
    # Checks first, then the instance's episode, with the run's choice; the config saw no benchmark param.
    assert bench.calls("benchmark_trial_tasks")[0][1:] == ("tb2", 2, "/data")
    assert bench.calls("benchmark_instance")[0][1:] == ("tb2", "L1", 1, "tb2_a", "/data", True)  # in a pod
    assert bench.calls("benchmark_instance")[0][0].compute.backend == "kubernetes"

    grader_pod(cluster, name, f"tests ran\n{RESULT_BEGIN}\n0.75\n{RESULT_END}\n")
    cluster.batch.set_job_condition(name, "Complete")
    result = op.execute_complete(task_context(K8S), {"status": "succeeded", "job_name": name}, index=0)
    assert bench.recorded == {"tb2_a": 0.75, "tb2_b": 1.0}
    [(_config, *args)] = bench.calls("benchmark_grader_result")
    assert tuple(args) == ("tb2", "L1", 1, "tb2_a", f"tests ran\n{RESULT_BEGIN}\n0.75\n{RESULT_END}", "/data")
    assert result == {"backend": "kubernetes", "result": {"mean": 0.875}}
    assert cluster.terminating["jobs"] == {name}, "the grader Job is deleted once its result is recorded"
    assert len(bench.calls("benchmark_trial_record")) == 1


def test_a_failed_grader_job_fails_the_task_with_its_log_tail(bench, cluster):
    op = operator()
    name = defer(op).trigger.job_name
    pod = grader_pod(cluster, name, "applying patch\nerror: corrupt patch at line 7", phase="Failed")
    cluster.batch.set_job_condition(name, "Failed", "BackoffLimitExceeded")
    with pytest.raises(GraderJobFailed) as caught:
        op.execute_complete(task_context(K8S), {"status": "failed", "message": "Failed: BackoffLimitExceeded",
                                                "job_name": name}, index=0)  # fmt: skip
    message = str(caught.value)
    assert message.startswith(f"grader Job {name} failed: Failed: BackoffLimitExceeded")
    assert f"--- {pod} {GRADER_CONTAINER} (last 40 lines) ---" in message and "corrupt patch at line 7" in message
    assert bench.calls("benchmark_grader_result") == [] and "tb2_a" not in bench.recorded
    assert cluster.terminating["jobs"] == {name}
    assert bench.calls("benchmark_trial_record") == []


def test_a_retry_reads_a_finished_job_once_and_records_once(bench, cluster):
    name = defer(operator()).trigger.job_name  # try 1 created the Job and died while it ran
    grader_pod(cluster, name, f"{RESULT_BEGIN}\n1\n{RESULT_END}")
    cluster.batch.set_job_condition(name, "Complete")
    result = operator().execute(task_context(K8S))  # try 2: the Job had succeeded
    assert result["result"] == {"mean": 1.0} and bench.recorded["tb2_a"] == 1.0
    assert [c for c in cluster.calls if c == ("batch", "jobs", "create")] == [("batch", "jobs", "create")]
    operator().execute(task_context(K8S))  # try 3 (a cleared task): every instance is recorded
    assert len(bench.calls("benchmark_grader_result")) == 1
    assert [c for c in cluster.calls if c == ("batch", "jobs", "create")] == [("batch", "jobs", "create")]


def test_a_retry_reattaches_to_a_running_job_and_replaces_a_failed_one(bench, cluster):
    name = defer(operator()).trigger.job_name
    assert defer(operator()).trigger.job_name == name
    assert [c for c in cluster.calls if c == ("batch", "jobs", "create")] == [("batch", "jobs", "create")]
    cluster.batch.set_job_condition(name, "Failed", "DeadlineExceeded")
    defer(operator())
    assert [c for c in cluster.calls if c == ("batch", "jobs", "create")] == [("batch", "jobs", "create")] * 2
    assert ("batch", "jobs", "watch") in cluster.calls, "the failed Job is gone before its name is reused"
    assert "status" not in cluster.objects["jobs"][name]


def test_kill_deletes_the_grader_job_in_flight(bench, cluster):
    op = operator()
    name = defer(op).trigger.job_name
    op.on_kill()
    assert cluster.terminating["jobs"] == {name}


def test_local_backend_runs_the_trial_in_process(bench, cluster):
    result = operator().execute(task_context(LOCAL))
    assert result == {"backend": "local", "result": {"benchmark": "tb2", "mean": 0.5}}
    [(config, *args)] = bench.calls("benchmark_trial")
    assert tuple(args) == ("tb2", "L1", 1, 2, "/data") and config.compute.backend == "local"
    assert cluster.calls == []


# --- the episode sandbox pod ------------------------------------------------------------------------------------------

SERVER = {"endpoint": "http://vllm-c-l1.mass-ops.svc:8000/v1", "served_name": "L1"}
EPISODE = {"kind": "benchmark", "task_id": "tb2_a", "candidate": 1, "generation": "L1", "seed": 3_000_101,
           "condition": "tb2_L1_t1", "prompt_uri": "file:///p/ab.txt", "prompt_sha256": "ab" * 32}  # fmt: skip


class PodBenchmarkStages(FakeBenchmarkStages):
    """Instance `tb2_a` has no recorded episode until its pod records one (as the pod's publisher does); then its
    grading needs a grader Job."""

    def __init__(self, stages, repo, budget_stop: str | None = None) -> None:
        super().__init__(stages)
        self.repo, self.budget_stop = repo, budget_stop

    def episode_recorded(self) -> bool:
        rows = self.repo.episodes(self.repo.cycle_id, task_id="tb2_a", kind="benchmark", generation="L1")
        return any(row.status == "succeeded" for row in rows)

    def instance(self, config, benchmark, generation, trial, task, data_dir, episode_pod):
        if task == "tb2_a" and task not in self.recorded and not self.episode_recorded():
            if self.budget_stop:
                return {"status": "budget_exhausted", "task": task, "message": self.budget_stop}
            return {"status": "episode", "task": task, "cycle": config.cycle_name, "episode": dict(EPISODE),
                    "wall_clock_s": 600, "server": dict(SERVER)}  # fmt: skip
        return super().instance(config, benchmark, generation, trial, task, data_dir, episode_pod)


def record_benchmark_episode(repo, status: str = "succeeded") -> None:
    repo.record_episode(repo.cycle_id, task_id="tb2_a", kind="benchmark", seed=EPISODE["seed"], candidate=1,
                        generation="L1", condition="tb2_L1_t1", status=status)  # fmt: skip


@pytest.fixture
def pod_bench(stages, cycle_store, cluster, chart_settings):
    repo = cycle_store({k: v for k, v in K8S.items() if k not in ("generation", "limit", "data_dir")})
    return PodBenchmarkStages(stages, repo)


@pytest.fixture
def pod_waits():
    """The pod manager's waits patched, as the provider's own operator tests do (see test_episode_operator)."""
    from unittest import mock

    from airflow.providers.cncf.kubernetes.utils.pod_manager import PodManager

    with (
        mock.patch.object(PodManager, "await_pod_start", new_callable=mock.AsyncMock) as start,
        mock.patch.object(PodManager, "fetch_requested_container_logs") as logs,
    ):
        yield start, logs


def created_pods(cluster) -> list[dict]:
    pods: list[dict] = []
    previous = cluster.on_pod_created

    def created(manifest: dict) -> None:
        pods.append(manifest)
        if previous is not None:
            previous(manifest)

    cluster.on_pod_created = created
    return pods


def test_an_unrecorded_episode_runs_in_its_sandbox_pod_then_is_graded(pod_bench, cluster, pod_waits):
    from tests.deploy.chart_render import validate_manifest

    cluster.on_pod_created = lambda manifest: record_benchmark_episode(pod_bench.repo)
    pods = created_pods(cluster)
    op = BenchmarkTrialOperator(task_id="benchmark_trial", unit=["tb2", 1], deferrable=False)
    deferral = defer(op)  # the pod ran (synchronously here); then the grader Job of the now recorded episode
    assert isinstance(deferral.trigger, JobCompletionTrigger) and deferral.kwargs == {"index": 0}
    [pod] = pods
    validate_manifest({k: v for k, v in pod.items() if k != "status"})  # as created (the stand-in adds a status)
    spec = pod["spec"]
    base = next(c for c in spec["containers"] if c["name"] == "base")
    command = base["command"]
    # The stage's bound request, the task's time limit and the generation's server, as run options.
    assert command[:3] == ["mass-ops", "episode", "run"]
    for flag, value in (("--kind", "benchmark"), ("--task", "tb2_a"), ("--candidate", "1"), ("--generation", "L1"),
                        ("--seed", "3000101"), ("--condition", "tb2_L1_t1"), ("--wall-clock-s", "600"),
                        ("--endpoint", SERVER["endpoint"]), ("--served-name", "L1")):  # fmt: skip
        assert command[command.index(flag) + 1] == value, flag
    config = bench_config()
    deadline = 600 * config.runtime.max_infra_attempts + 900  # the task's limit, not the config's
    assert spec["activeDeadlineSeconds"] == episode_deadline_s(config, 600) == deadline
    # The sandbox pod: the NetworkPolicy's label, no token, non-root, and of the Secrets only the inference key (in
    # the proxy container; the store's credentials are the publisher's).
    labels = pod["metadata"]["labels"]
    assert labels["mass-ops/role"] == "episode" and labels["mass-ops/task"] == "tb2_a"
    assert labels["mass-ops/episode-kind"] == "benchmark"
    assert spec["automountServiceAccountToken"] is False and base["securityContext"]["runAsNonRoot"] is True
    assert not base.get("envFrom") and all(not e.get("valueFrom") for e in base["env"])
    [proxy] = spec["initContainers"]
    assert [e["name"] for e in proxy["env"] if e.get("valueFrom")] == [config.inference.api_key_env]
    assert not cluster.objects["pods"], "the pod is deleted once it finished"
    # The stage was asked again after the pod: it found the episode recorded and returned the grader Job.
    assert [args[4] for args in pod_bench.calls("benchmark_instance")] == ["tb2_a", "tb2_a"]


def test_the_episode_pod_is_leased_as_it_is_created(pod_bench, cluster, pod_waits):
    """Until the pod's publisher records the episode, its lease makes `status` count the unit in flight."""
    record_benchmark_episode(pod_bench.repo, status="infra_failure")  # attempt 1 failed: the pod runs attempt 2
    seen: list[Any] = []

    def created(manifest: dict) -> None:
        leases = pod_bench.repo.episode_leases(pod_bench.repo.cycle_id)
        seen.append((manifest["metadata"]["name"], [(lease.unit_key, lease.attempt, lease.host) for lease in leases]))
        pod_bench.repo.record_episode(pod_bench.repo.cycle_id, task_id="tb2_a", kind="benchmark", seed=EPISODE["seed"],
                                      candidate=1, generation="L1", status="succeeded", attempt=2)  # fmt: skip

    cluster.on_pod_created = created
    defer(BenchmarkTrialOperator(task_id="benchmark_trial", unit=["tb2", 1], deferrable=False))
    [(pod, [(key, attempt, where)])] = seen
    assert (key, attempt) == (f"benchmark-ttb2_a-c1-s{EPISODE['seed']}-gL1", 2)
    assert pod.startswith(f"{where}-"), "the pod's name before the provider's random suffix"


def bench_config():
    from mass_ops_airflow.params import build_config

    return build_config({k: v for k, v in K8S.items() if k not in ("generation", "limit", "data_dir")})


def test_a_retry_does_not_relaunch_a_recorded_episode(pod_bench, cluster, pod_waits):
    record_benchmark_episode(pod_bench.repo)  # try 1's pod recorded the episode, then the task died
    deferral = defer(BenchmarkTrialOperator(task_id="benchmark_trial", unit=["tb2", 1], deferrable=False))
    assert isinstance(deferral.trigger, JobCompletionTrigger)
    assert ("", "pods", "create") not in cluster.calls


def test_the_episode_pod_waits_in_the_triggerer_and_resumes_with_the_instance(pod_bench, cluster, pod_waits):
    from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger

    op = BenchmarkTrialOperator(task_id="benchmark_trial", unit=["tb2", 1])
    deferral = defer(op)
    assert isinstance(deferral.trigger, KubernetesPodTrigger) and deferral.method_name == "episode_complete"
    assert deferral.kwargs["index"] == 0 and deferral.kwargs["episode"]["episode"] == EPISODE
    (pod_name,) = cluster.objects["pods"]
    record_benchmark_episode(pod_bench.repo)  # what the pod's publisher does before the pod succeeds
    event = {"status": "success", "name": pod_name, "namespace": "mass-ops"}
    with pytest.raises(TaskDeferred) as caught:
        BenchmarkTrialOperator(task_id="benchmark_trial", unit=["tb2", 1]).episode_complete(
            task_context(K8S), event, **deferral.kwargs
        )
    assert isinstance(caught.value.trigger, JobCompletionTrigger) and caught.value.kwargs == {"index": 0}
    assert not cluster.objects["pods"], "the finished pod is cleaned up on re-entry"


def test_kill_deletes_the_episode_pod_in_flight(pod_bench, cluster, pod_waits):
    op = BenchmarkTrialOperator(task_id="benchmark_trial", unit=["tb2", 1])
    defer(op)
    assert len(cluster.objects["pods"]) == 1
    op.on_kill()
    assert not cluster.objects["pods"]


def test_a_pod_that_records_no_episode_fails_the_task(pod_bench, cluster, pod_waits):
    from mass_ops_airflow.checks import StageOutputMissing

    with pytest.raises(StageOutputMissing, match="benchmark-L1-ttb2_a-c1: the pod exited 0 but the metadata store"):
        BenchmarkTrialOperator(task_id="benchmark_trial", unit=["tb2", 1], deferrable=False).execute(task_context(K8S))
    assert pod_bench.calls("benchmark_grader_result") == []


def test_a_budget_stop_creates_no_pod_and_fails_without_retry(pod_bench, cluster, pod_waits):
    from airflow.sdk.exceptions import AirflowFailException

    pod_bench.budget_stop = "task budget tb2_a spent: raise budgets.task_tokens"
    with pytest.raises(AirflowFailException, match="tb2_a: no episode pod created: task budget tb2_a spent"):
        BenchmarkTrialOperator(task_id="benchmark_trial", unit=["tb2", 1]).execute(task_context(K8S))
    assert ("", "pods", "create") not in cluster.calls
