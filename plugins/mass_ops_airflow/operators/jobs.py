"""Training and export as Kubernetes Jobs on GPU nodes — the run's compute backend's `job_workload` — or, when the
backend runs work in process (local), the stage function.

Training runs as an indexed Job: `training.nnodes` pods with `training.gpus_per_node` GPUs each, node rank = the
completion index, rendezvous through a headless Service named like the Job (`mass_ops.compute.kubernetes`) — or,
with `compute.kubernetes.training_launcher: trainjob`, as a Kubeflow Trainer TrainJob created, read and deleted
through the custom-objects API (its JobSet brings the pods and their Service). Export runs as a one-pod Job that
writes the next generation into the model cache and the artifact store.

The wait is deferred (`JobCompletionTrigger`, `TrainJobCompletionTrigger`), failing early when a pod cannot be
scheduled within the cluster's `startup_timeout_s` or its image cannot be pulled. A retry re-attaches to a Job (or
TrainJob) still running from the previous try and replaces a failed one. After success the stores must hold the
stage's outputs (post-check); a failure carries the failed pods' log tails. Kill or failure deletes what was created.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk import BaseOperator

from mass_ops_airflow.checks import export_published, training_recorded
from mass_ops_airflow.cycle import call_stage, cycle_config

if TYPE_CHECKING:
    from airflow.sdk import Context

    from mass_ops.compute.backend import JobWorkload
    from mass_ops.config import CycleConfig


class GpuJobOperator(BaseOperator):
    """Base of the training and export operators; subclasses name the role, stage and post-check.

    :param kubernetes_conn_id: Airflow Kubernetes connection (None: in-cluster config).
    :param poll_interval_s: seconds between Job status reads while deferred.
    :param delete_timeout_s: how long to wait for a failed Job of a previous try to disappear before replacing it.
    """

    role: ClassVar[str]
    local_stage: ClassVar[str]
    post_check: ClassVar[Callable[[CycleConfig], dict[str, Any]]]
    template_fields: Sequence[str] = ()
    ui_color = "#fdebd0"

    def __init__(
        self,
        *,
        kubernetes_conn_id: str | None = None,
        poll_interval_s: float = 30.0,
        delete_timeout_s: int = 600,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.kubernetes_conn_id = kubernetes_conn_id
        self.poll_interval_s = poll_interval_s
        self.delete_timeout_s = delete_timeout_s
        self._created: dict[str, Any] | None = None

    def _check(self, config: CycleConfig) -> dict[str, Any]:
        return type(self).post_check(config)

    def execute(self, context: Context) -> dict[str, Any]:
        from mass_ops.compute.backend import backend_for

        config = cycle_config(context["params"])
        backend = backend_for(config)
        workload = backend.job_workload(config, self.role)  # type: ignore[arg-type]
        if workload is None:
            # In-process the stage's own return is the outcome; the post-check guards what a pod's exit cannot tell.
            return {"backend": backend.name, "result": call_stage(self.local_stage, config)}
        if workload.kind == "TrainJob":
            return self._execute_trainjob(config, workload)
        return self._execute_job(config, workload)

    def _uses_trainjob(self, config: CycleConfig) -> bool:
        return self.role == "train" and config.compute.kubernetes.training_launcher == "trainjob"

    def _execute_job(self, config: CycleConfig, workload: JobWorkload) -> dict[str, Any]:
        from mass_ops.compute import kubernetes as specs
        from mass_ops_airflow.kube import MassKubeHook, job_state
        from mass_ops_airflow.triggers import JobCompletionTrigger

        job, service = workload.manifest, workload.service
        assert service is not None, "a Job comes with its rendezvous Service"
        name, namespace = workload.name, workload.namespace
        hook = MassKubeHook(self.kubernetes_conn_id)
        self._created = {"job": name, "service": service["metadata"]["name"], "namespace": namespace}
        existing = hook.read_job(name, namespace)
        if existing is not None:
            state, _ = job_state(existing)
            if state == "succeeded":
                self.log.info("Job %s already succeeded in a previous try", name)
                return self._complete(config, {"status": "succeeded"})
            if state == "failed":
                self.log.info("Replacing Job %s, which failed in a previous try", name)
                hook.delete_objects(namespace, jobs=[name])
                hook.wait_jobs_gone(
                    namespace,
                    specs.scope_selector(config, config.cycle_name, {"mass-ops/job": self.role}),
                    timeout_s=self.delete_timeout_s,
                )
                existing = None
            else:
                self.log.info("Re-attaching to Job %s, still running from a previous try", name)
        hook.ensure_service(service)  # DNS for rendezvous exists before any pod starts
        if existing is None:
            hook.start_job(job)
            self.log.info("Created Job %s (%s pods)", name, job["spec"]["completions"])
        self.defer(
            trigger=JobCompletionTrigger(
                job_name=name,
                namespace=namespace,
                conn_id=self.kubernetes_conn_id,
                schedule_timeout_s=config.compute.kubernetes.startup_timeout_s,
                poll_interval_s=self.poll_interval_s,
                service_name=service["metadata"]["name"],
            ),
            method_name="execute_complete",
        )

    def _execute_trainjob(self, config: CycleConfig, workload: JobWorkload) -> dict[str, Any]:
        from mass_ops_airflow.kube import MassKubeHook, trainjob_state
        from mass_ops_airflow.triggers import TrainJobCompletionTrigger

        manifest = workload.manifest
        name, namespace = workload.name, workload.namespace
        hook = MassKubeHook(self.kubernetes_conn_id)
        self._created = {"trainjob": name, "namespace": namespace}
        existing = hook.read_trainjob(name, namespace)
        if existing is not None:
            state, _ = trainjob_state(existing)
            if state == "succeeded":
                self.log.info("TrainJob %s already succeeded in a previous try", name)
                return self._complete(config, {"status": "succeeded"})
            if state == "failed":
                self.log.info("Replacing TrainJob %s, which failed in a previous try", name)
                hook.delete_objects(namespace, trainjobs=[name])
                hook.wait_trainjob_gone(name, namespace, timeout_s=self.delete_timeout_s)
                existing = None
            else:
                self.log.info("Re-attaching to TrainJob %s, still running from a previous try", name)
        if existing is None:
            hook.start_trainjob(manifest)
            self.log.info("Created TrainJob %s (%s nodes)", name, manifest["spec"]["trainer"]["numNodes"])
        self.defer(
            trigger=TrainJobCompletionTrigger(
                trainjob_name=name,
                namespace=namespace,
                conn_id=self.kubernetes_conn_id,
                schedule_timeout_s=config.compute.kubernetes.startup_timeout_s,
                poll_interval_s=self.poll_interval_s,
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume after the Job ended: delete it and its Service, then post-check — or fail with the log tails."""
        return self._complete(cycle_config(context["params"]), event)

    def _complete(self, config: CycleConfig, event: dict[str, Any]) -> dict[str, Any]:
        from mass_ops.compute import kubernetes as specs
        from mass_ops.compute.backend import backend_for
        from mass_ops_airflow.kube import MassKubeHook

        name = specs.job_name(config, self.role)  # type: ignore[arg-type]
        namespace = config.compute.kubernetes.namespace
        hook = MassKubeHook(self.kubernetes_conn_id)
        trainjob = self._uses_trainjob(config)
        kind, label = ("TrainJob", specs.JOBSET_NAME_LABEL) if trainjob else ("Job", specs.JOB_NAME_LABEL)
        tails = None
        if event.get("status") != "succeeded":
            tails = hook.failed_pod_tails(namespace, f"{label}={name}")
        if trainjob:
            hook.delete_objects(namespace, trainjobs=[name])
        else:
            hook.delete_objects(namespace, jobs=[name], services=[name])
        if tails is not None:
            message = event.get("message") or event.get("status")
            raise RuntimeError(f"{self.role} {kind} {name} failed: {message}\n{tails}")
        return {"backend": backend_for(config).name, "job": name, "check": self._check(config)}

    def on_kill(self) -> None:
        if not self._created:
            return
        from mass_ops_airflow.kube import MassKubeHook

        hook = MassKubeHook(self.kubernetes_conn_id)
        created = self._created
        if "trainjob" in created:
            deleted = hook.delete_objects(created["namespace"], trainjobs=[created["trainjob"]])
        else:
            deleted = hook.delete_objects(created["namespace"], jobs=[created["job"]], services=[created["service"]])
        self.log.info("Task killed: deleted %s", ", ".join(deleted) or "nothing (already gone)")


class TrainingJobOperator(GpuJobOperator):
    """LoRA SFT of the cycle: a (multi-node) GPU Job — or Kubeflow TrainJob, per `compute.kubernetes.
    training_launcher` — running `mass-ops stage train`, or the `train` stage locally."""

    role = "train"
    local_stage = "train"
    post_check = staticmethod(training_recorded)


class ExportJobOperator(GpuJobOperator):
    """Merge + FP8 export of the next generation: a GPU Job running `mass-ops stage export`, or `export` locally."""

    role = "export"
    local_stage = "export"
    post_check = staticmethod(export_published)
