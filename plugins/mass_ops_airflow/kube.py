"""`MassKubeHook`: the Kubernetes API calls the mass-ops operators and triggers share (blocking; triggers run them in
a thread), and the pure readings of pod, Job and TrainJob states they decide on.

The hook is the provider's `KubernetesHook` (same connection, same cached CoreV1/AppsV1/BatchV1/CustomObjects
clients over one API client) with every call bounded: each passes `_request_timeout` (`request_timeout`, default
`REQUEST_TIMEOUT_S`), and a watch passes its own, longer one. Every call is one of the verbs the Helm chart's Role
grants (helm/mass-ops/templates/rbac.yaml); a test records the calls the operators make and compares them with it.
Import this module lazily (inside `execute`, or from the triggerer): it loads the Kubernetes client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
from kubernetes.client.exceptions import ApiException

if TYPE_CHECKING:
    from kubernetes.client import V1Job, V1Pod

# Container waiting reasons that never resolve by themselves: fail now instead of waiting out a timeout.
FATAL_WAITING_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "CrashLoopBackOff",
    }
)
LOG_TAIL_LINES = 40

# (connect, read) seconds of every API call: the Kubernetes client waits forever by default, so an API server that
# accepts and never answers would hang the task. A watch sets its own (events may be minutes apart).
REQUEST_TIMEOUT_S = (10.0, 60.0)
# Added to a watch's server-side `timeout_seconds` for its read timeout: the server ends the stream first.
WATCH_READ_MARGIN_S = 30

RequestTimeout = tuple[float, float]
T = TypeVar("T")


def is_not_found(exc: BaseException) -> bool:
    return getattr(exc, "status", None) == 404


def _trainjob_api(namespace: str) -> dict[str, str]:
    from mass_ops.compute.kubernetes import TRAINJOB_GROUP, TRAINJOB_PLURAL, TRAINJOB_VERSION

    return {"group": TRAINJOB_GROUP, "version": TRAINJOB_VERSION, "namespace": namespace, "plural": TRAINJOB_PLURAL}


def _name_ns(manifest: dict[str, Any]) -> tuple[str, str]:
    return manifest["metadata"]["name"], manifest["metadata"]["namespace"]


def _or_none(read: Callable[[], T]) -> T | None:
    """`read()`, or None when the object does not exist (another API error propagates)."""
    try:
        return read()
    except ApiException as exc:
        if is_not_found(exc):
            return None
        raise


class MassKubeHook(KubernetesHook):
    """The Kubernetes connection of the mass-ops operators and triggers, every API call bounded in time.

    :param conn_id: Airflow Kubernetes connection id; None: the provider's default (`kubernetes_default`, or
        in-cluster / kubeconfig defaults when that connection does not exist).
    :param request_timeout: (connect, read) seconds passed as `_request_timeout` on every call but a watch's.
    :param kwargs: the provider hook's other parameters (`in_cluster`, `config_file`, `cluster_context`, ...).
    """

    hook_name = "mass-ops Kubernetes"

    def __init__(
        self, conn_id: str | None = None, *, request_timeout: RequestTimeout = REQUEST_TIMEOUT_S, **kwargs: Any
    ) -> None:
        super().__init__(conn_id=conn_id, **kwargs)
        self.request_timeout = request_timeout

    @property
    def _timed(self) -> dict[str, Any]:
        return {"_request_timeout": self.request_timeout}

    def _watcher(self) -> Any:
        from kubernetes import watch

        return watch.Watch()

    # -- reads ---------------------------------------------------------------------------------------------------

    def get_pod(self, name: str, namespace: str) -> V1Pod:
        """The pod `name` (ApiException when there is none)."""
        return self.core_v1_client.read_namespaced_pod(name=name, namespace=namespace, **self._timed)

    def get_job(self, job_name: str, namespace: str) -> V1Job:
        """The Job `job_name` with its status (ApiException when there is none). The full object, not the
        `jobs/status` subresource the launcher Role does not grant."""
        return self.batch_v1_client.read_namespaced_job(name=job_name, namespace=namespace, **self._timed)

    def read_pod(self, name: str, namespace: str) -> V1Pod | None:
        """The pod `name`, or None when there is none."""
        return _or_none(lambda: self.get_pod(name, namespace))

    def read_job(self, name: str, namespace: str) -> V1Job | None:
        """The Job `name`, or None when there is none."""
        return _or_none(lambda: self.get_job(name, namespace))

    def read_trainjob(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The TrainJob `name` as a dict (the custom-objects API returns plain JSON), or None when there is none."""
        return _or_none(
            lambda: self.custom_object_client.get_namespaced_custom_object(
                **_trainjob_api(namespace), name=name, **self._timed
            )
        )

    def list_pods(self, namespace: str, selector: str) -> list[V1Pod]:
        """The pods matching the label `selector`."""
        return list(
            self.core_v1_client.list_namespaced_pod(namespace=namespace, label_selector=selector, **self._timed).items
        )

    def read_pod_log(self, name: str, namespace: str, *, container: str, tail_lines: int | None = None) -> str:
        """The container's log (its last `tail_lines` lines when given), decoded."""
        tail = {} if tail_lines is None else {"tail_lines": tail_lines}
        text = self.core_v1_client.read_namespaced_pod_log(
            name=name, namespace=namespace, container=container, **tail, **self._timed
        )
        return text.decode("utf-8", errors="replace") if isinstance(text, bytes) else str(text)

    def log_tail(self, name: str, namespace: str, *, container: str = "base", lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of a container's log, or a note saying why there is none."""
        return log_tail(
            self.core_v1_client, name, namespace, container=container, lines=lines, request_timeout=self.request_timeout
        )

    def failed_pod_tails(self, namespace: str, selector: str, *, lines: int = LOG_TAIL_LINES) -> str:
        """Log tails of the pods that failed among those matching `selector` (all pods when none is marked failed)."""
        pods = self.list_pods(namespace, selector)
        failed = [p for p in pods if p.status is not None and p.status.phase == "Failed"] or pods
        parts = []
        for pod in failed:
            tail = self.log_tail(pod.metadata.name, namespace, lines=lines)
            parts.append(f"--- {pod.metadata.name} (last {lines} lines) ---\n{tail}")
        return "\n".join(parts) if parts else "(no pods found)"

    def pods_problem(
        self, namespace: str, selector: str, *, schedule_timeout_s: float, now: datetime | None = None
    ) -> str | None:
        """The first fatal problem among the pods matching `selector`, or None."""
        for pod in self.list_pods(namespace, selector):
            problem = pod_problem(pod, schedule_timeout_s=schedule_timeout_s, now=now)
            if problem:
                return problem
        return None

    # -- creation ------------------------------------------------------------------------------------------------

    def start_pod(self, manifest: dict[str, Any]) -> None:
        """Create the pod `manifest` (ApiException 409 while one of its name still exists)."""
        self.core_v1_client.create_namespaced_pod(namespace=_name_ns(manifest)[1], body=manifest, **self._timed)

    def start_job(self, manifest: dict[str, Any]) -> None:
        """Create the Job `manifest`."""
        self.batch_v1_client.create_namespaced_job(namespace=_name_ns(manifest)[1], body=manifest, **self._timed)

    def start_trainjob(self, manifest: dict[str, Any]) -> None:
        """Create the Kubeflow TrainJob `manifest`."""
        self.custom_object_client.create_namespaced_custom_object(
            **_trainjob_api(_name_ns(manifest)[1]), body=manifest, **self._timed
        )

    def apply_deployment(self, manifest: dict[str, Any]) -> str:
        """Create the Deployment, or patch it to `manifest` when it exists (a retry after a changed spec)."""
        name, namespace = _name_ns(manifest)
        apps = self.apps_v1_client
        if _or_none(lambda: apps.read_namespaced_deployment(name=name, namespace=namespace, **self._timed)) is None:
            apps.create_namespaced_deployment(namespace=namespace, body=manifest, **self._timed)
            return "created"
        apps.patch_namespaced_deployment(name=name, namespace=namespace, body=manifest, **self._timed)
        return "patched"

    def ensure_service(self, manifest: dict[str, Any]) -> str:
        """Create the Service unless one of that name exists (Services of a name are identical by construction)."""
        name, namespace = _name_ns(manifest)
        core = self.core_v1_client
        if _or_none(lambda: core.read_namespaced_service(name=name, namespace=namespace, **self._timed)) is not None:
            return "exists"
        core.create_namespaced_service(namespace=namespace, body=manifest, **self._timed)
        return "created"

    # -- deletion ------------------------------------------------------------------------------------------------

    def _delete_quietly(self, delete: Callable[..., Any], **kwargs: Any) -> bool:
        """Whether the object existed (and is now being deleted)."""
        try:
            delete(**kwargs, **self._timed)
            return True
        except ApiException as exc:
            if is_not_found(exc):
                return False
            raise

    def delete_pod(self, name: str, namespace: str) -> bool:
        """Delete the pod `name`; whether it existed."""
        return self._delete_quietly(self.core_v1_client.delete_namespaced_pod, name=name, namespace=namespace)

    def delete_objects(
        self,
        namespace: str,
        *,
        deployments: Iterable[str] = (),
        services: Iterable[str] = (),
        jobs: Iterable[str] = (),
        trainjobs: Iterable[str] = (),
    ) -> list[str]:
        """Delete the named objects (missing ones are fine); returns `kind/name` of those that existed.

        Deployments, Jobs and TrainJobs go with foreground propagation so their pods (and GPUs) are gone before the
        object is.
        """
        deleted = []
        custom, apps, batch = self.custom_object_client, self.apps_v1_client, self.batch_v1_client
        for name in trainjobs:
            api = _trainjob_api(namespace)
            if self._delete_quietly(
                custom.delete_namespaced_custom_object, **api, name=name, propagation_policy="Foreground"
            ):
                deleted.append(f"trainjob/{name}")
        for name in deployments:
            if self._delete_quietly(
                apps.delete_namespaced_deployment, name=name, namespace=namespace, propagation_policy="Foreground"
            ):
                deleted.append(f"deployment/{name}")
        for name in jobs:
            if self._delete_quietly(
                batch.delete_namespaced_job, name=name, namespace=namespace, propagation_policy="Foreground"
            ):
                deleted.append(f"job/{name}")
        for name in services:
            if self._delete_quietly(self.core_v1_client.delete_namespaced_service, name=name, namespace=namespace):
                deleted.append(f"service/{name}")
        return deleted

    def delete_selected(self, namespace: str, selector: str, *, timeout_s: int = 600) -> list[str]:
        """Delete every Deployment and Service matching `selector` and wait until they are gone.

        Listing by label (not by name) also removes servers a previous attempt created under a different spec.
        """
        list_deployments = self.apps_v1_client.list_namespaced_deployment
        list_services = self.core_v1_client.list_namespaced_service
        deployments = [d.metadata.name for d in self._listed(list_deployments, namespace, selector)]
        services = [s.metadata.name for s in self._listed(list_services, namespace, selector)]
        deleted = self.delete_objects(namespace, deployments=deployments, services=services)
        self._wait_gone(list_deployments, namespace, selector, timeout_s=timeout_s)
        self._wait_gone(list_services, namespace, selector, timeout_s=timeout_s)
        return deleted

    def wait_jobs_gone(self, namespace: str, selector: str, *, timeout_s: int) -> None:
        """Block until no Job matching `selector` remains (a watch, not a poll); TimeoutError after `timeout_s`."""
        self._wait_gone(self.batch_v1_client.list_namespaced_job, namespace, selector, timeout_s=timeout_s)

    def _watch_timeout(self, timeout_s: int) -> RequestTimeout:
        # Events may be minutes apart: the read timeout outlasts the server-side one instead of the default read.
        return (self.request_timeout[0], timeout_s + WATCH_READ_MARGIN_S)

    def _listed(self, list_function: Callable[..., Any], namespace: str, selector: str) -> list[Any]:
        return list(list_function(namespace=namespace, label_selector=selector, **self._timed).items)

    def _wait_gone(self, list_function: Callable[..., Any], namespace: str, selector: str, *, timeout_s: int) -> None:
        """Block until no object `list_function` lists under `selector` remains; TimeoutError after `timeout_s`."""
        remaining = {item.metadata.name for item in self._listed(list_function, namespace, selector)}
        if not remaining:
            return
        watcher = self._watcher()
        for event in watcher.stream(
            list_function,
            namespace=namespace,
            label_selector=selector,
            timeout_seconds=timeout_s,
            _request_timeout=self._watch_timeout(timeout_s),
        ):
            if event["type"] == "DELETED":
                remaining.discard(event["object"].metadata.name)
            if not remaining:
                watcher.stop()
                return
        left = {item.metadata.name for item in self._listed(list_function, namespace, selector)}
        if left:
            raise TimeoutError(f"still present after {timeout_s} s: {sorted(left)}")

    def wait_trainjob_gone(self, name: str, namespace: str, *, timeout_s: int) -> None:
        """Block until the TrainJob `name` is gone (a watch, not a poll); TimeoutError after `timeout_s`."""
        if self.read_trainjob(name, namespace) is None:
            return
        watcher = self._watcher()
        for event in watcher.stream(
            self.custom_object_client.list_namespaced_custom_object,
            **_trainjob_api(namespace),
            field_selector=f"metadata.name={name}",
            timeout_seconds=timeout_s,
            _request_timeout=self._watch_timeout(timeout_s),
        ):
            if event["type"] == "DELETED" and event["object"]["metadata"]["name"] == name:
                watcher.stop()
                return
        if self.read_trainjob(name, namespace) is not None:
            raise TimeoutError(f"TrainJob {name} still present after {timeout_s} s")


def log_tail(
    core: Any,
    name: str,
    namespace: str,
    *,
    container: str = "base",
    lines: int = LOG_TAIL_LINES,
    request_timeout: RequestTimeout = REQUEST_TIMEOUT_S,
) -> str:
    """The last `lines` lines of a container's log read through the CoreV1 client `core` (also the provider's pod
    operator's), or a note saying why there is none."""
    try:
        text = core.read_namespaced_pod_log(
            name=name, namespace=namespace, container=container, tail_lines=lines, _request_timeout=request_timeout
        )
    except ApiException as exc:
        return f"(log of {name} unavailable: {getattr(exc, 'reason', exc)})"
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return str(text).rstrip() or f"(log of {name} is empty)"


# -- pure readings of the objects' states ------------------------------------------------------------------------


def _age_s(timestamp: Any, now: datetime | None) -> float:
    if timestamp is None:
        return 0.0
    now = now or datetime.now(tz=UTC)
    if timestamp.tzinfo is None:
        timestamp = timestamp.replace(tzinfo=UTC)
    return float((now - timestamp).total_seconds())


def pod_problem(pod: Any, *, schedule_timeout_s: float, now: datetime | None = None) -> str | None:
    """Why this pod will not start by itself, or None: a fatal waiting reason, or unschedulable too long."""
    name = pod.metadata.name
    status = pod.status
    for container in (getattr(status, "container_statuses", None) or []) if status else []:
        waiting = container.state.waiting if container.state else None
        if waiting is not None and waiting.reason in FATAL_WAITING_REASONS:
            return f"pod {name}: container {container.name} is {waiting.reason}: {waiting.message or ''}".rstrip(": ")
    for condition in (getattr(status, "conditions", None) or []) if status else []:
        if condition.type == "PodScheduled" and condition.status == "False":
            age = _age_s(condition.last_transition_time or pod.metadata.creation_timestamp, now)
            if age >= schedule_timeout_s:
                return (
                    f"pod {name} could not be scheduled for {age:.0f} s (limit {schedule_timeout_s:g} s): "
                    f"{condition.reason or ''} {condition.message or ''}".rstrip()
                )
    return None


def job_state(job: Any) -> tuple[str, str]:
    """(`running` | `succeeded` | `failed`, message) from the Job's conditions."""
    for condition in getattr(job.status, "conditions", None) or []:
        if condition.status != "True":
            continue
        if condition.type == "Complete":
            return "succeeded", ""
        if condition.type == "Failed":
            return "failed", f"{condition.reason or 'Failed'}: {condition.message or ''}".rstrip(": ")
    return "running", ""


def trainjob_state(trainjob: dict[str, Any]) -> tuple[str, str]:
    """(`running` | `succeeded` | `failed`, message) from the TrainJob's conditions (Trainer v2: Complete, Failed)."""
    for condition in (trainjob.get("status") or {}).get("conditions") or []:
        if condition.get("status") != "True":
            continue
        if condition.get("type") == "Complete":
            return "succeeded", ""
        if condition.get("type") == "Failed":
            reason, message = condition.get("reason") or "Failed", condition.get("message") or ""
            return "failed", f"{reason}: {message}".rstrip(": ")
    return "running", ""
