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
    """KubernetesPodOperator whose failure message carries the log tail of each of the pod's containers.

    The tails are read before the provider's cleanup deletes the pod, so the evidence survives in the task log and
    in the exception the task fails with. An episode pod has two containers (the sandbox `base`, and the publisher
    that uploads what it hands over); the provider waits for the pod's phase, so both have ended by then.
    """

    log_tail_lines = kube.LOG_TAIL_LINES

    def __init__(self, *, tail_containers: tuple[str, ...] = ("base",), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tail_containers = tail_containers

    def cleanup(self, pod: Any, remote_pod: Any, xcom_result: dict | None = None, context: Any = None) -> None:
        tails: list[str] = []
        phase = getattr(getattr(remote_pod, "status", None), "phase", None)
        if remote_pod is not None and not self._killed and phase != "Succeeded":
            for container in self.tail_containers:
                tail = kube.log_tail(
                    self.client,
                    remote_pod.metadata.name,
                    remote_pod.metadata.namespace,
                    container=container,
                    lines=self.log_tail_lines,
                )
                tails.append(f"last {self.log_tail_lines} lines of the pod's log, container {container}:\n{tail}")
        try:
            super().cleanup(pod, remote_pod, xcom_result, context)
        except AirflowException as exc:
            if not tails or isinstance(exc, SandboxPodFailed):
                raise
            raise SandboxPodFailed("\n".join([str(exc), *tails])) from None


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
        tail_containers=tuple(container["name"] for container in manifest["spec"]["containers"]),
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
