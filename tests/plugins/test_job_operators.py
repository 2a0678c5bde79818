"""Training and export Jobs: indexed GPU Job + headless Service (or a Kubeflow TrainJob), deferred wait, re-attach on
retry, log tails on failure, deletion on kill, and a post-check of the stores after success."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import TaskDeferred
from mass_ops_airflow.checks import StageOutputMissing
from mass_ops_airflow.operators import ExportJobOperator, TrainingJobOperator
from mass_ops_airflow.triggers import JobCompletionTrigger, TrainJobCompletionTrigger

from mass_ops.compute.kubernetes import job_name
from mass_ops.store.artifact_backends import open_artifact_store
from tests.support.airflow import task_context, use_training_launcher

K8S = {"preset": "paper", "compute_backend": "kubernetes", "training_nnodes": 3}
TRAINJOB = K8S  # with the chart's training_launcher set to trainjob (`trainjob_repo`)


@pytest.fixture
def repo(cycle_store, cluster, chart_settings):
    return cycle_store(K8S)


def defer(operator, params=K8S) -> TaskDeferred:
    with pytest.raises(TaskDeferred) as caught:
        operator.execute(task_context(params))
    return caught.value


def finished_training(repo, *, with_checkpoint: bool = True) -> None:
    run = repo.ensure_training_run(repo.cycle_id, "sft", {"steps": 1624})
    repo.set_training_run_status(run.id, "succeeded")
    repo.record_checkpoint(run.id, 0, val_loss=1.5)
    if with_checkpoint:
        repo.record_checkpoint(run.id, 150, uri="s3://b/ckpt/150", val_loss=1.2)


def add_failed_pod(cluster, job: str) -> str:
    name = f"{job}-1-x7k"
    cluster.objects["pods"][name] = {
        "metadata": {"name": name, "labels": {"batch.kubernetes.io/job-name": job}},
        "spec": {"containers": [{"name": "base", "image": "i"}]},
        "status": {"phase": "Failed"},
    }
    cluster.logs[name] = "\n".join(["step 10 loss 1.3", "torch.OutOfMemoryError: CUDA out of memory"])
    return name


def test_training_creates_service_and_indexed_job_then_defers(repo, cluster):
    deferral = defer(TrainingJobOperator(task_id="train"))
    name = job_name(repo.config, "train")
    assert isinstance(deferral.trigger, JobCompletionTrigger) and deferral.method_name == "execute_complete"
    assert deferral.trigger.job_name == name and deferral.trigger.schedule_timeout_s == 1800
    job = cluster.objects["jobs"][name]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 3
    assert name in cluster.objects["services"]
    order = [c for c in cluster.calls if c[2] == "create"]
    assert order == [("", "services", "create"), ("batch", "jobs", "create")], "DNS exists before any pod starts"


def test_success_cleans_up_and_checks_the_store(repo, cluster):
    operator = TrainingJobOperator(task_id="train")
    defer(operator)
    finished_training(repo)
    result = operator.execute_complete(task_context(K8S), {"status": "succeeded"})
    assert result["check"]["best_step"] == 150 and result["job"] == job_name(repo.config, "train")
    assert cluster.terminating["jobs"] == {result["job"]} and cluster.terminating["services"] == {result["job"]}


def test_success_without_checkpoints_fails_the_post_check(repo, cluster):
    operator = TrainingJobOperator(task_id="train")
    defer(operator)
    finished_training(repo, with_checkpoint=False)
    with pytest.raises(StageOutputMissing, match="no saved checkpoint with a validation loss after step 0"):
        operator.execute_complete(task_context(K8S), {"status": "succeeded"})


def test_failure_carries_the_failed_pods_log_tail(repo, cluster):
    operator = TrainingJobOperator(task_id="train")
    defer(operator)
    name = job_name(repo.config, "train")
    pod = add_failed_pod(cluster, name)
    with pytest.raises(RuntimeError) as caught:
        operator.execute_complete(task_context(K8S), {"status": "failed", "message": "Failed: BackoffLimitExceeded"})
    message = str(caught.value)
    assert message.startswith(f"train Job {name} failed: Failed: BackoffLimitExceeded")
    assert f"--- {pod} (last 40 lines) ---" in message and "CUDA out of memory" in message
    assert cluster.terminating["jobs"] == {name}


def test_retry_reattaches_to_a_running_job(repo, cluster):
    defer(TrainingJobOperator(task_id="train"))
    defer(TrainingJobOperator(task_id="train"))
    assert [c for c in cluster.calls if c == ("batch", "jobs", "create")] == [("batch", "jobs", "create")]


def test_retry_replaces_a_failed_job(repo, cluster):
    defer(TrainingJobOperator(task_id="train"))
    name = job_name(repo.config, "train")
    cluster.batch.set_job_condition(name, "Failed", "pod failed")
    defer(TrainingJobOperator(task_id="train"))
    assert [c for c in cluster.calls if c == ("batch", "jobs", "create")] == [("batch", "jobs", "create")] * 2
    assert ("batch", "jobs", "watch") in cluster.calls, "the old Job must be gone before its name is reused"
    assert "status" not in cluster.objects["jobs"][name], "the new Job starts afresh"


def test_a_job_that_already_succeeded_is_not_rerun(repo, cluster):
    defer(TrainingJobOperator(task_id="train"))
    name = job_name(repo.config, "train")
    cluster.batch.set_job_condition(name, "Complete")
    finished_training(repo)
    result = TrainingJobOperator(task_id="train").execute(task_context(K8S))
    assert result["check"]["best_step"] == 150
    assert [c for c in cluster.calls if c == ("batch", "jobs", "create")] == [("batch", "jobs", "create")]


def test_kill_deletes_job_and_service(repo, cluster):
    operator = TrainingJobOperator(task_id="train")
    defer(operator)
    operator.on_kill()
    name = job_name(repo.config, "train")
    assert cluster.terminating["jobs"] == {name} and cluster.terminating["services"] == {name}


def test_export_checks_the_published_weights(repo, cluster, tmp_path):
    operator = ExportJobOperator(task_id="export")
    deferral = defer(operator)
    job = cluster.objects["jobs"][deferral.trigger.job_name]
    assert job["spec"]["completions"] == 1
    with pytest.raises(StageOutputMissing, match="no bf16 safetensors under 'models/L1-bf16'"):
        operator.execute_complete(task_context(K8S), {"status": "succeeded"})
    store = open_artifact_store(str(tmp_path / "artifacts"))
    store.put_bytes("models/L1-bf16/model-00001.safetensors", b"x")
    store.put_bytes("models/L1-fp8/model-00001.safetensors", b"y")
    store.put_bytes("models/L1-fp8/model-00002.safetensors", b"z")
    defer(ExportJobOperator(task_id="export"))
    result = operator.execute_complete(task_context(K8S), {"status": "succeeded"})
    assert result["check"] == {"shards": {"bf16": 1, "fp8": 2}}


def test_local_backend_calls_the_stage(stages, cluster):
    result = TrainingJobOperator(task_id="train").execute(task_context({"preset": "demo"}))
    assert stages.names() == ["train"] and result == {"backend": "local", "result": {"stage": "train"}}
    ExportJobOperator(task_id="export").execute(task_context({"preset": "demo"}))
    assert stages.names() == ["train", "export"] and cluster.calls == []


# --- training as a Kubeflow TrainJob ----------------------------------------------------------------------------


@pytest.fixture
def trainjob_repo(cycle_store, cluster, chart_settings):
    use_training_launcher(chart_settings, "trainjob")
    return cycle_store(TRAINJOB)


def test_trainjob_launcher_creates_a_trainjob_and_nothing_else(trainjob_repo, cluster):
    deferral = defer(TrainingJobOperator(task_id="train"), TRAINJOB)
    name = job_name(trainjob_repo.config, "train")
    assert isinstance(deferral.trigger, TrainJobCompletionTrigger) and deferral.trigger.trainjob_name == name
    trainjob = cluster.objects["trainjobs"][name]
    assert trainjob["kind"] == "TrainJob" and trainjob["spec"]["trainer"]["numNodes"] == 3
    assert [c for c in cluster.calls if c[2] == "create"] == [("trainer.kubeflow.org", "trainjobs", "create")]
    assert not cluster.objects["jobs"] and not cluster.objects["services"], "the JobSet brings pods and Service"


def test_trainjob_success_deletes_it_and_checks_the_store(trainjob_repo, cluster):
    operator = TrainingJobOperator(task_id="train")
    defer(operator, TRAINJOB)
    finished_training(trainjob_repo)
    result = operator.execute_complete(task_context(TRAINJOB), {"status": "succeeded"})
    assert result["check"]["best_step"] == 150 and cluster.terminating["trainjobs"] == {result["job"]}


def test_trainjob_failure_carries_the_node_pods_log_tails(trainjob_repo, cluster):
    operator = TrainingJobOperator(task_id="train")
    defer(operator, TRAINJOB)
    name = job_name(trainjob_repo.config, "train")
    pod = f"{name}-node-0-1-x7k"
    cluster.objects["pods"][pod] = {
        "metadata": {"name": pod, "labels": {"jobset.sigs.k8s.io/jobset-name": name}},
        "spec": {"containers": [{"name": "node", "image": "i"}]},
        "status": {"phase": "Failed"},
    }
    cluster.logs[pod] = "torch.OutOfMemoryError: CUDA out of memory"
    with pytest.raises(RuntimeError) as caught:
        operator.execute_complete(task_context(TRAINJOB), {"status": "failed", "message": "Failed: node exited 1"})
    message = str(caught.value)
    assert (
        message.startswith(f"train TrainJob {name} failed: Failed: node exited 1") and "CUDA out of memory" in message
    )
    assert cluster.terminating["trainjobs"] == {name}


def test_trainjob_retry_reattaches_or_replaces(trainjob_repo, cluster):
    defer(TrainingJobOperator(task_id="train"), TRAINJOB)
    defer(TrainingJobOperator(task_id="train"), TRAINJOB)
    creates = [c for c in cluster.calls if c == ("trainer.kubeflow.org", "trainjobs", "create")]
    assert len(creates) == 1, "a running TrainJob is re-attached"
    name = job_name(trainjob_repo.config, "train")
    cluster.set_trainjob_condition(name, "Failed", "DeadlineExceeded")
    defer(TrainingJobOperator(task_id="train"), TRAINJOB)
    assert ("trainer.kubeflow.org", "trainjobs", "watch") in cluster.calls, "the failed one is gone first"
    assert "status" not in cluster.objects["trainjobs"][name], "the new TrainJob starts afresh"


def test_trainjob_kill_deletes_it(trainjob_repo, cluster):
    operator = TrainingJobOperator(task_id="train")
    defer(operator, TRAINJOB)
    operator.on_kill()
    assert cluster.terminating["trainjobs"] == {job_name(trainjob_repo.config, "train")}


def test_export_stays_a_job_with_the_trainjob_launcher(trainjob_repo, cluster):
    defer(ExportJobOperator(task_id="export"), TRAINJOB)
    assert list(cluster.objects["jobs"]) == [job_name(trainjob_repo.config, "export")]
    assert not cluster.objects["trainjobs"]
