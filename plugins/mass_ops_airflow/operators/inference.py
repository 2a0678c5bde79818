"""Bring the cycle's model server(s) up and down, asking the run's compute backend (`mass_ops.compute.backend`).

A backend that runs in process (local): the `inference_up` / `inference_down` stage functions (a detached
`transformers serve`). Otherwise (Kubernetes) the backend's `model_workloads` — one vLLM Deployment + ClusterIP
Service per served model — are applied here, then a deferred wait until every server is ready
(`InferenceReadinessTrigger`). A readiness failure deletes what was created before the task fails — a failed setup
task's teardown does not run — and so does killing the task. The same readiness rule holds on both.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from airflow.sdk import BaseOperator

from mass_ops_airflow.cycle import call_stage, cycle_config

if TYPE_CHECKING:
    from airflow.sdk import Context

    from mass_ops.compute.backend import ComputeBackend
    from mass_ops.compute.kubernetes import ServingTarget
    from mass_ops.config import CycleConfig

ServeWhat = Literal["current", "evaluation"]


def serving_targets(config: CycleConfig, serve: ServeWhat | Sequence[dict[str, str]]) -> list[ServingTarget]:
    """What to serve: the cycle's model (`current`), it and the new generation (`evaluation`), or explicit targets."""
    from mass_ops.compute.kubernetes import ServingTarget, current_serving_target, next_serving_target

    if serve == "current":
        return [current_serving_target(config)]
    if serve == "evaluation":
        return [current_serving_target(config), next_serving_target(config)]
    if isinstance(serve, str):
        raise ValueError(f"serve: {serve!r} is not current, evaluation or a list of targets")
    return [ServingTarget(str(t["served_name"]), str(t["model_key"])) for t in serve]


class InferenceServerOperator(BaseOperator):
    """Start the model server(s) of a cycle and return once each is ready; XCom: endpoints and served names.

    :param serve: `current` (the cycle's model), `evaluation` (current + next generation) or a list of
        `{"served_name", "model_key"}` (templated; the nightly DAG passes the generations it evaluates).
    :param scope: names and labels of the servers (templated); default: the cycle's name.
    :param kubernetes_conn_id: Airflow Kubernetes connection (None: in-cluster config).
    :param poll_interval_s: seconds between readiness probes.
    :param local_stage: stage function that starts the local server (local backend).
    :param local_teardown_stage: stage function that stops it when it never became ready (local backend).
    """

    template_fields: Sequence[str] = ("serve", "scope")
    ui_color = "#d6eaf8"

    def __init__(
        self,
        *,
        serve: ServeWhat | Sequence[dict[str, str]] | str = "current",
        scope: str | None = None,
        kubernetes_conn_id: str | None = None,
        poll_interval_s: float = 10.0,
        local_stage: str = "inference_up",
        local_teardown_stage: str = "inference_down",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.serve = serve
        self.local_teardown_stage = local_teardown_stage
        self.scope = scope
        self.kubernetes_conn_id = kubernetes_conn_id
        self.poll_interval_s = poll_interval_s
        self.local_stage = local_stage
        self._created: dict[str, Any] | None = None

    def execute(self, context: Context) -> dict[str, Any]:
        from mass_ops.compute.backend import backend_for

        config = cycle_config(context["params"])
        backend = backend_for(config)
        if backend.runs_in_process:
            return self._execute_in_process(config, backend)
        return self._launch(config, backend)

    def _execute_in_process(self, config: CycleConfig, backend: ComputeBackend) -> dict[str, Any]:
        from mass_ops_airflow.triggers import InferenceReadinessTrigger

        result = call_stage(self.local_stage, config) or {}
        if isinstance(result, dict) and "servers" in result:
            servers = result["servers"]  # the stage says what it serves (evaluation: two generations)
        else:
            servers = [{"endpoint": config.inference.endpoint, "served_name": config.models.served_name}]
        if not servers:
            return {"backend": backend.name, "servers": []}
        if all(_ready_now(server, config.inference.api_key_env) for server in servers):
            # The local stages wait for readiness themselves; deferring a task that is already done only meets
            # Airflow's race between a fast trigger and the deferral (apache/airflow#67287).
            return {"backend": backend.name, "servers": servers}
        self.defer(
            trigger=InferenceReadinessTrigger(
                servers=servers,
                deadline_ts=time.time() + config.inference.server.readiness_timeout_s,
                poll_interval_s=self.poll_interval_s,
                api_key_env=config.inference.api_key_env,
            ),
            method_name="execute_complete",
        )

    def _launch(self, config: CycleConfig, backend: ComputeBackend) -> dict[str, Any]:
        from mass_ops.compute.backend import to_launch
        from mass_ops_airflow.kube import MassKubeHook
        from mass_ops_airflow.triggers import InferenceReadinessTrigger

        scope = self.scope or config.cycle_name
        namespace = config.compute.kubernetes.namespace
        workloads = to_launch(backend.model_workloads(config, serving_targets(config, self.serve), scope), "serve")
        hook = MassKubeHook(self.kubernetes_conn_id)
        cleanup: dict[str, Any] = {
            "conn_id": self.kubernetes_conn_id,
            "namespace": namespace,
            "deployments": [],
            "services": [],
        }
        self._created = cleanup
        servers = []
        for workload in workloads:
            deployment, service = workload.deployment, workload.service
            cleanup["deployments"].append(deployment["metadata"]["name"])
            cleanup["services"].append(service["metadata"]["name"])
            action = hook.apply_deployment(deployment)
            hook.ensure_service(service)
            self.log.info("Deployment %s %s for %s", deployment["metadata"]["name"], action, workload.served_name)
            servers.append({"endpoint": workload.endpoint, "served_name": workload.served_name})
        k8s = config.compute.kubernetes
        self.defer(
            trigger=InferenceReadinessTrigger(
                servers=servers,
                deadline_ts=time.time() + config.inference.server.readiness_timeout_s,
                poll_interval_s=self.poll_interval_s,
                api_key_env=config.inference.api_key_env,
                kubernetes={
                    "conn_id": self.kubernetes_conn_id,
                    "namespace": namespace,
                    "selector": backend.model_selector(config, scope),
                    "schedule_timeout_s": k8s.startup_timeout_s,
                },
                cleanup=cleanup,
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume after the readiness wait: the servers, or a clear failure (after deleting what was created)."""
        from mass_ops.compute.backend import backend_for

        config = cycle_config(context["params"])
        backend = backend_for(config)
        cleanup = event.get("cleanup")
        if event.get("status") == "ready":
            return {"backend": backend.name, "servers": event["servers"]}
        # A failed setup task's teardown does not run: stop what this task started before failing.
        if cleanup:
            self._delete(cleanup)
        elif backend.runs_in_process:
            call_stage(self.local_teardown_stage, config)
        timeout = config.inference.server.readiness_timeout_s
        what = "not ready within" if event.get("status") == "timeout" else "failed to start within"
        raise RuntimeError(
            f"inference server {what} the readiness timeout ({timeout} s): {event.get('message', 'no detail')}"
        )

    def _delete(self, cleanup: dict[str, Any]) -> None:
        from mass_ops_airflow.kube import MassKubeHook

        deleted = MassKubeHook(cleanup.get("conn_id")).delete_objects(
            cleanup["namespace"], deployments=cleanup["deployments"], services=cleanup["services"]
        )
        self.log.info("Deleted %s", ", ".join(deleted) or "nothing (already gone)")

    def on_kill(self) -> None:
        if self._created:
            self._delete(self._created)


def _ready_now(server: dict[str, str], api_key_env: str) -> bool:
    """One readiness probe of a local server (health OK and the served name listed)."""
    from mass_ops.compute.readiness import probe

    return probe(server["endpoint"], server["served_name"], api_key_env=api_key_env, timeout_s=2.0).ready


class InferenceServerTeardownOperator(BaseOperator):
    """Stop the servers of a scope: every Deployment and Service labelled with it, waiting until they are gone.

    Meant as a teardown task: it runs when the work fails too, so GPUs are never left held by a dead run.

    :param scope: the scope the servers were started under (templated); default: the cycle's name.
    :param kubernetes_conn_id: Airflow Kubernetes connection (None: in-cluster config).
    :param local_stage: stage function that stops the local server (local backend).
    :param delete_timeout_s: how long to wait for the objects (and their pods) to disappear.
    """

    template_fields: Sequence[str] = ("scope",)
    ui_color = "#fadbd8"

    def __init__(
        self,
        *,
        scope: str | None = None,
        kubernetes_conn_id: str | None = None,
        local_stage: str = "inference_down",
        delete_timeout_s: int = 600,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.scope = scope
        self.kubernetes_conn_id = kubernetes_conn_id
        self.local_stage = local_stage
        self.delete_timeout_s = delete_timeout_s

    def execute(self, context: Context) -> dict[str, Any]:
        from mass_ops.compute.backend import backend_for

        config = cycle_config(context["params"])
        backend = backend_for(config)
        selector = backend.model_selector(config, self.scope or config.cycle_name)
        if selector is None:  # nothing was launched: the stage function stops the server it started
            return {"backend": backend.name, "result": call_stage(self.local_stage, config)}
        from mass_ops_airflow.kube import MassKubeHook

        deleted = MassKubeHook(self.kubernetes_conn_id).delete_selected(
            config.compute.kubernetes.namespace, selector, timeout_s=self.delete_timeout_s
        )
        self.log.info("Deleted %s", ", ".join(deleted) or "nothing (already gone)")
        return {"backend": backend.name, "deleted": deleted}


def registered_targets(config: CycleConfig, names: Sequence[str]) -> list[dict[str, str]]:
    """Serving targets of registered generations: served under their registered served name (else their name),
    loaded from `models/<name>-fp8` in the model cache (where export writes generation `<name>`)."""
    from mass_ops_airflow.hooks import MassMetadataHook

    repo = MassMetadataHook().get_repository(config.storage.metadata_url)
    targets = []
    for name in names:
        generation = repo.get_generation(name)
        if generation is None:
            raise ValueError(f"generation {name!r} is not registered in the metadata store")
        targets.append({"served_name": generation.served_name or name, "model_key": f"models/{name}-fp8"})
    return targets
