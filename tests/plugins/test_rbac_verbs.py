"""The launcher Role in the Helm chart grants what the operators use — the calls are recorded, not assumed.

Every operator and trigger path (start, ready, time out, fail, retry/re-attach, replace, kill, teardown) runs
against the recording fake API; the verbs it used are compared with the chart test's OPERATOR_VERBS (which the
chart's Role must equal). Nothing used may be missing from the Role. What the Role grants beyond these calls is
listed in UNUSED_GRANTS with the reason; a change on either side makes this test fail until the list is updated.
"""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
from airflow.providers.cncf.kubernetes.utils.pod_manager import PodManager
from airflow.sdk.exceptions import TaskDeferred
from mass_ops_airflow.operators import (
    EpisodePodOperator,
    ExportJobOperator,
    InferenceServerOperator,
    InferenceServerTeardownOperator,
    TrainingJobOperator,
)
from mass_ops_airflow.operators._pod import SandboxPodFailed

from mass_ops.compute.kubernetes import job_name
from tests.deploy.test_helm_chart import OPERATOR_VERBS
from tests.plugins.test_triggers import run_trigger
from tests.support.airflow import task_context, use_training_launcher

K8S = {"preset": "paper", "compute_backend": "kubernetes", "overrides": ['tasks.catalogue="builtin"']}

UNUSED_GRANTS: dict[tuple[str, str], set[str]] = {
    # The provider's pod trigger streams a deferred pod's events from the triggerer
    # (AsyncKubernetesHook.watch_pod_events); the triggerer is not run here. `get` completes the read-only trio.
    ("", "events"): {"get", "watch"},
    # Nothing watches pods: pod states are read (get/list) by the operators and triggers.
    ("", "pods"): {"watch"},
}


def deferred(operator, params=K8S):
    with pytest.raises(TaskDeferred) as caught:
        operator.execute(task_context(params))
    return caught.value


def exercise_everything(cluster, repo, settings) -> None:
    """Drive every Kubernetes path of the operators and triggers once."""
    # Inference: start (create), retry (get + patch), readiness failure (delete), kill, diagnostics, teardown.
    up = InferenceServerOperator(task_id="inference_up", serve="evaluation")
    trigger = deferred(up).trigger
    deferred(InferenceServerOperator(task_id="inference_up", serve="evaluation"))
    asyncio.run(asyncio.wait_for(trigger._pods_problem(), 10))
    up.execute_complete(task_context(K8S), {"status": "ready", "servers": [], "cleanup": trigger.cleanup_spec})
    with pytest.raises(RuntimeError):
        up.execute_complete(task_context(K8S), {"status": "timeout", "message": "m", "cleanup": trigger.cleanup_spec})
    deferred(up)
    up.on_kill()
    asyncio.run(trigger.on_kill())
    InferenceServerTeardownOperator(task_id="inference_down").execute(task_context(K8S))

    # Episodes: success, failure with log tail, deferred + kill, re-attach.
    with (
        mock.patch.object(PodManager, "await_pod_start", new_callable=mock.AsyncMock),
        mock.patch.object(PodManager, "fetch_requested_container_logs"),
    ):
        cluster.pod_outcome = ("Failed", 1)
        with pytest.raises(SandboxPodFailed):
            EpisodePodOperator(task_id="t", kind="reference", task=51, deferrable=False).execute(task_context(K8S))
        cluster.pod_outcome = ("Running", None)
        episode = EpisodePodOperator(task_id="t", kind="reference", task=51)
        deferred(episode)
        deferred(EpisodePodOperator(task_id="t", kind="reference", task=51))  # re-attaches
        episode.on_kill()
        cluster.pod_outcome = ("Succeeded", 0)
        cluster.on_pod_created = lambda manifest: repo.record_episode(
            repo.cycle_id, task_id=51, kind="reference", seed=450051, status="succeeded"
        )
        EpisodePodOperator(task_id="t", kind="reference", task=51, deferrable=False).execute(task_context(K8S))

    # Training and export: create, re-attach, replace a failed Job, trigger, failure tails, kill, success cleanup.
    train = TrainingJobOperator(task_id="train")
    deferred(train)
    deferred(TrainingJobOperator(task_id="train"))
    name = job_name(repo.config, "train")
    cluster.batch.set_job_condition(name, "Failed", "x")
    deferred(TrainingJobOperator(task_id="train"))
    with pytest.raises(RuntimeError):
        train.execute_complete(task_context(K8S), {"status": "failed", "message": "x"})
    export = ExportJobOperator(task_id="export")
    trigger = deferred(export).trigger
    cluster.batch.set_job_condition(trigger.job_name, "Complete")
    assert run_trigger(trigger)["status"] == "succeeded"
    export.on_kill()
    asyncio.run(trigger.on_kill())

    # Training as a Kubeflow TrainJob: create, re-attach, replace a failed one, trigger, failure tails, kill.
    use_training_launcher(settings, "trainjob")
    trainjob = TrainingJobOperator(task_id="train")
    trigger = deferred(trainjob, K8S).trigger
    deferred(TrainingJobOperator(task_id="train"), K8S)
    cluster.set_trainjob_condition(trigger.trainjob_name, "Failed", "x")
    deferred(TrainingJobOperator(task_id="train"), K8S)
    with pytest.raises(RuntimeError):
        trainjob.execute_complete(task_context(K8S), {"status": "failed", "message": "x"})
    cluster.objects["trainjobs"].clear()
    trigger = deferred(trainjob, K8S).trigger
    cluster.set_trainjob_condition(trigger.trainjob_name, "Complete")
    assert run_trigger(trigger)["status"] == "succeeded"
    trainjob.on_kill()
    asyncio.run(trigger.on_kill())


def test_role_grants_exactly_what_the_operators_use(cycle_store, cluster, chart_settings):
    repo = cycle_store(K8S)
    exercise_everything(cluster, repo, chart_settings)
    used = cluster.verbs()
    missing = {key: verbs - OPERATOR_VERBS.get(key, set()) for key, verbs in used.items()}
    missing = {key: verbs for key, verbs in missing.items() if verbs}
    assert missing == {}, f"the operators call verbs the chart's Role does not grant: {missing}"
    unused = {key: verbs - used.get(key, set()) for key, verbs in OPERATOR_VERBS.items()}
    unused = {key: verbs for key, verbs in unused.items() if verbs}
    assert unused == UNUSED_GRANTS
