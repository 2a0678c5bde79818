"""Deferrable waits of the mass-ops operators: model-server readiness, Job and TrainJob completion.

`run()` only observes (HTTP probes, Kubernetes reads) and yields one event; it creates and deletes nothing. Deadlines
are absolute timestamps so a triggerer restart does not extend a wait. `on_kill()` — called by Airflow 3.3+ only when
a user kills the deferred task — deletes what the operator created, the same way the operator's own `on_kill` does.
Blocking Kubernetes calls run in a worker thread so the triggerer's event loop never stalls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from mass_ops.compute.kubernetes import JOB_NAME_LABEL
from mass_ops.compute.readiness import probe_async
from mass_ops_airflow.kube import MassKubeHook, job_state, trainjob_state


class InferenceReadinessTrigger(BaseTrigger):
    """Wait until every server is ready: `/health` answers 200 and `/v1/models` lists its served name.

    :param servers: `{"endpoint": ".../v1", "served_name": ...}` per server.
    :param deadline_ts: give up at this UNIX time (the config's `inference.server.readiness_timeout_s` from start).
    :param poll_interval_s: seconds between probes.
    :param api_key_env: NAME of the environment variable holding the server's key (never the key itself).
    :param kubernetes: optional `{"conn_id", "namespace", "selector", "schedule_timeout_s"}`: also watch the
        servers' pods and fail fast on a fatal state (image pull errors, crash loops, unschedulable too long).
    :param cleanup: optional `{"conn_id", "namespace", "deployments", "services"}` deleted by `on_kill`.
    """

    def __init__(
        self,
        *,
        servers: list[dict[str, str]],
        deadline_ts: float,
        poll_interval_s: float = 10.0,
        api_key_env: str | None = None,
        kubernetes: dict[str, Any] | None = None,
        cleanup: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.servers = servers
        self.deadline_ts = deadline_ts
        self.poll_interval_s = poll_interval_s
        self.api_key_env = api_key_env
        self.kubernetes = kubernetes
        self.cleanup_spec = cleanup

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "servers": self.servers,
                "deadline_ts": self.deadline_ts,
                "poll_interval_s": self.poll_interval_s,
                "api_key_env": self.api_key_env,
                "kubernetes": self.kubernetes,
                "cleanup": self.cleanup_spec,
            },
        )

    async def _pods_problem(self) -> str | None:
        spec = self.kubernetes
        if not spec:
            return None

        def check() -> str | None:
            return MassKubeHook(spec.get("conn_id")).pods_problem(
                spec["namespace"], spec["selector"], schedule_timeout_s=spec["schedule_timeout_s"]
            )

        return await asyncio.to_thread(check)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        problems: dict[str, str] = {}
        while True:
            reports = [
                await probe_async(s["endpoint"], s["served_name"], api_key_env=self.api_key_env) for s in self.servers
            ]
            problems = {r.endpoint: r.problem for r in reports if r.problem}
            if not problems:
                yield TriggerEvent({"status": "ready", "servers": self.servers, "cleanup": self.cleanup_spec})
                return
            fatal = await self._pods_problem()
            if fatal:
                yield TriggerEvent(
                    {"status": "failed", "message": fatal, "servers": self.servers, "cleanup": self.cleanup_spec}
                )
                return
            if time.time() >= self.deadline_ts:
                detail = "; ".join(f"{endpoint}: {problem}" for endpoint, problem in sorted(problems.items()))
                yield TriggerEvent(
                    {"status": "timeout", "message": detail, "servers": self.servers, "cleanup": self.cleanup_spec}
                )
                return
            await asyncio.sleep(min(self.poll_interval_s, max(0.0, self.deadline_ts - time.time())))

    async def on_kill(self) -> None:
        spec = self.cleanup_spec
        if not spec:
            return

        def delete() -> list[str]:
            return MassKubeHook(spec.get("conn_id")).delete_objects(
                spec["namespace"], deployments=spec.get("deployments", ()), services=spec.get("services", ())
            )

        deleted = await asyncio.to_thread(delete)
        self.log.info("Task killed: deleted %s", ", ".join(deleted) or "nothing (already gone)")


class _CompletionTrigger(BaseTrigger):
    """Wait until a Kubernetes workload finishes, failing fast when its pods cannot start (the shared loop of the
    Job and TrainJob triggers). A subclass names its workload's field (`name_field`), reads its state
    (`_observe`) and deletes it (`_delete`); the event carries the state, a message and the workload's name under
    `name_field`."""

    name_field = "name"

    def __init__(
        self,
        workload_name: str,
        *,
        namespace: str,
        conn_id: str | None,
        schedule_timeout_s: float,
        poll_interval_s: float = 30.0,
    ) -> None:
        super().__init__()
        self.workload_name = workload_name
        self.namespace = namespace
        self.conn_id = conn_id
        self.schedule_timeout_s = schedule_timeout_s
        self.poll_interval_s = poll_interval_s

    def _extra_fields(self) -> dict[str, Any]:
        """Serialized fields beyond the shared ones."""
        return {}

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                self.name_field: self.workload_name,
                "namespace": self.namespace,
                "conn_id": self.conn_id,
                "schedule_timeout_s": self.schedule_timeout_s,
                "poll_interval_s": self.poll_interval_s,
                **self._extra_fields(),
            },
        )

    def _observe(self) -> tuple[str, str]:
        raise NotImplementedError

    def _delete(self, hook: MassKubeHook) -> list[str]:
        raise NotImplementedError

    def _with_pod_problems(self, state: str, message: str, hook: MassKubeHook, selector: str) -> tuple[str, str]:
        """A running workload whose pods cannot start (unschedulable too long, image pull errors) has failed."""
        if state == "running":
            problem = hook.pods_problem(self.namespace, selector, schedule_timeout_s=self.schedule_timeout_s)
            if problem:
                return "failed", problem
        return state, message

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            state, message = await asyncio.to_thread(self._observe)
            if state != "running":
                yield TriggerEvent({"status": state, "message": message, self.name_field: self.workload_name})
                return
            await asyncio.sleep(self.poll_interval_s)

    async def on_kill(self) -> None:
        def delete() -> list[str]:
            return self._delete(MassKubeHook(self.conn_id))

        deleted = await asyncio.to_thread(delete)
        self.log.info("Task killed: deleted %s", ", ".join(deleted) or "nothing (already gone)")


class JobCompletionTrigger(_CompletionTrigger):
    """Wait until a Job completes or fails, failing fast when its pods cannot start.

    :param job_name: the Job (and its headless Service, deleted with it on kill).
    :param namespace: its namespace.
    :param conn_id: Airflow Kubernetes connection id (None: in-cluster).
    :param schedule_timeout_s: how long a pod may stay unschedulable (GPU pods wait for nodes: generous).
    :param poll_interval_s: seconds between status reads.
    :param service_name: headless Service to delete with the Job on kill (None: none).
    """

    name_field = "job_name"

    def __init__(self, *, job_name: str, service_name: str | None = None, **common: Any) -> None:
        super().__init__(job_name, **common)
        self.service_name = service_name

    @property
    def job_name(self) -> str:
        return self.workload_name

    def _extra_fields(self) -> dict[str, Any]:
        return {"service_name": self.service_name}

    def _observe(self) -> tuple[str, str]:
        hook = MassKubeHook(self.conn_id)
        job = hook.get_job(self.workload_name, self.namespace)  # raises when the Job is gone (unlike a TrainJob)
        return self._with_pod_problems(*job_state(job), hook, f"{JOB_NAME_LABEL}={self.workload_name}")

    def _delete(self, hook: MassKubeHook) -> list[str]:
        services = [self.service_name] if self.service_name else []
        return hook.delete_objects(self.namespace, jobs=[self.workload_name], services=services)


class TrainJobCompletionTrigger(_CompletionTrigger):
    """Wait until a Kubeflow TrainJob completes or fails, failing fast when its pods cannot start.

    :param trainjob_name: the TrainJob (its JobSet labels every pod with this name).
    :param namespace: its namespace.
    :param conn_id: Airflow Kubernetes connection id (None: in-cluster).
    :param schedule_timeout_s: how long a pod may stay unschedulable.
    :param poll_interval_s: seconds between status reads.
    """

    name_field = "trainjob_name"

    def __init__(self, *, trainjob_name: str, **common: Any) -> None:
        super().__init__(trainjob_name, **common)

    @property
    def trainjob_name(self) -> str:
        return self.workload_name

    def _observe(self) -> tuple[str, str]:
        from mass_ops.compute.kubernetes import JOBSET_NAME_LABEL

        hook = MassKubeHook(self.conn_id)
        trainjob = hook.read_trainjob(self.workload_name, self.namespace)
        if trainjob is None:
            return "failed", f"TrainJob {self.workload_name} disappeared"
        return self._with_pod_problems(*trainjob_state(trainjob), hook, f"{JOBSET_NAME_LABEL}={self.workload_name}")

    def _delete(self, hook: MassKubeHook) -> list[str]:
        return hook.delete_objects(self.namespace, trainjobs=[self.workload_name])
