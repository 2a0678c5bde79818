"""The provider's KubernetesPodOperator, specialised for mass-ops sandbox pods (imported only when a pod runs).

Kept out of the operator modules DAG files import: importing the provider's pod operator pulls in the whole
Kubernetes client, which would multiply DAG parse time.
"""

from __future__ import annotations

from typing import Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk.exceptions import AirflowException

from mass_ops_airflow import kube


class SandboxPodFailed(AirflowException):
    """The sandbox pod failed; the message carries the tail of its log."""


class SandboxPodOperator(KubernetesPodOperator):
    """KubernetesPodOperator whose failure message carries the pod's log tail.

    The tail is read before the provider's cleanup deletes the pod, so the evidence survives in the task log and
    in the exception the task fails with.
    """

    log_tail_lines = kube.LOG_TAIL_LINES

    def cleanup(self, pod: Any, remote_pod: Any, xcom_result: dict | None = None, context: Any = None) -> None:
        tail = None
        phase = getattr(getattr(remote_pod, "status", None), "phase", None)
        if remote_pod is not None and not self._killed and phase != "Succeeded":
            tail = kube.log_tail(
                self.client,
                remote_pod.metadata.name,
                remote_pod.metadata.namespace,
                container=self.base_container_name,
                lines=self.log_tail_lines,
            )
        try:
            super().cleanup(pod, remote_pod, xcom_result, context)
        except AirflowException as exc:
            if tail is None or isinstance(exc, SandboxPodFailed):
                raise
            raise SandboxPodFailed(f"{exc}\nlast {self.log_tail_lines} lines of the pod's log:\n{tail}") from None


def sandbox_runner(
    *,
    task_id: str,
    manifest: dict[str, Any],
    kubernetes_conn_id: str | None,
    startup_timeout_s: int,
    deferrable: bool,
    poll_interval_s: float,
) -> SandboxPodOperator:
    """A pod operator that creates `manifest` (a full Pod dict from `mass_ops.compute.kubernetes`).

    GPU-free episode pods still wait for nodes and image pulls: both the schedule and the startup timeout are the
    cluster's `startup_timeout_s`. A retry re-attaches to a pod still running from the previous try (durable).
    """
    metadata = manifest["metadata"]
    return SandboxPodOperator(
        task_id=task_id,
        pod_template_dict=manifest,
        name=metadata["name"],
        namespace=metadata["namespace"],
        kubernetes_conn_id=kubernetes_conn_id,
        base_container_name="base",
        get_logs=True,
        log_events_on_failure=True,
        do_xcom_push=False,
        on_finish_action="delete_pod",
        on_kill_action="delete_pod",
        durable=True,
        startup_timeout_seconds=startup_timeout_s,
        schedule_timeout_seconds=startup_timeout_s,
        termination_grace_period=manifest["spec"].get("terminationGracePeriodSeconds"),
        deferrable=deferrable,
        poll_interval=poll_interval_s,
    )
