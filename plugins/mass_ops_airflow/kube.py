"""Kubernetes API calls the mass-ops operators and triggers share (blocking; triggers run them in a thread).

Every call here is one of the verbs the Helm chart's Role grants (helm/mass-ops/templates/rbac.yaml); a test
records the calls the operators make and compares them with that list. The kubernetes client is imported inside
the functions that need it, so importing this module costs nothing at DAG parse time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

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


@dataclass
class KubeClients:
    """The API groups mass-ops workloads live in; `custom` (CustomObjectsApi) reaches Kubeflow TrainJobs."""

    core: Any
    apps: Any
    batch: Any
    custom: Any = None


# (connect, read) seconds of every API call these clients make that sets no timeout of its own: the Kubernetes client
# waits forever by default, so an API server that accepts and never answers would hang the task. A watch sets its
# own (its server-side timeout plus a margin: events may be minutes apart).
REQUEST_TIMEOUT_S = (10.0, 60.0)


def with_request_timeout(api_client: Any, timeout: tuple[float, float] = REQUEST_TIMEOUT_S) -> Any:
    """`api_client` whose REST calls default to `timeout` when the call gives no `_request_timeout` (an explicit one
    still wins); returns it."""
    rest = api_client.rest_client
    request = rest.request

    def timed(*args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        return request(*args, _request_timeout=_request_timeout or timeout, **kwargs)

    rest.request = timed
    return api_client


def kubernetes_clients(conn_id: str | None) -> KubeClients:
    """Clients of the Airflow Kubernetes connection `conn_id` (None: in-cluster or kubeconfig defaults), every call
    bounded by `REQUEST_TIMEOUT_S` unless it sets its own."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    hook = KubernetesHook(conn_id=conn_id)
    with_request_timeout(hook.api_client)  # shared by the four clients below
    return KubeClients(
        core=hook.core_v1_client,
        apps=hook.apps_v1_client,
        batch=hook.batch_v1_client,
        custom=hook.custom_object_client,
    )


def is_not_found(exc: BaseException) -> bool:
    return getattr(exc, "status", None) == 404


def _api_exception() -> type[Exception]:
    from kubernetes.client.exceptions import ApiException

    return ApiException


def _name_ns(manifest: dict[str, Any]) -> tuple[str, str]:
    return manifest["metadata"]["name"], manifest["metadata"]["namespace"]


def apply_deployment(apps: Any, manifest: dict[str, Any]) -> str:
    """Create the Deployment, or patch it to `manifest` when it exists (a retry after a changed spec)."""
    name, namespace = _name_ns(manifest)
    api_exception = _api_exception()
    try:
        apps.read_namespaced_deployment(name=name, namespace=namespace)
    except api_exception as exc:
        if not is_not_found(exc):
            raise
        apps.create_namespaced_deployment(namespace=namespace, body=manifest)
        return "created"
    apps.patch_namespaced_deployment(name=name, namespace=namespace, body=manifest)
    return "patched"


def ensure_service(core: Any, manifest: dict[str, Any]) -> str:
    """Create the Service unless one of that name exists (Services of a name are identical by construction)."""
    name, namespace = _name_ns(manifest)
    api_exception = _api_exception()
    try:
        core.read_namespaced_service(name=name, namespace=namespace)
        return "exists"
    except api_exception as exc:
        if not is_not_found(exc):
            raise
    core.create_namespaced_service(namespace=namespace, body=manifest)
    return "created"


def _delete_quietly(delete: Callable[..., Any], **kwargs: Any) -> bool:
    api_exception = _api_exception()
    try:
        delete(**kwargs)
        return True
    except api_exception as exc:
        if is_not_found(exc):
            return False
        raise


def delete_objects(
    clients: KubeClients,
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
    for name in trainjobs:
        if _delete_quietly(
            clients.custom.delete_namespaced_custom_object,
            **_trainjob_api(namespace),
            name=name,
            propagation_policy="Foreground",
        ):
            deleted.append(f"trainjob/{name}")
    for name in deployments:
        if _delete_quietly(
            clients.apps.delete_namespaced_deployment, name=name, namespace=namespace, propagation_policy="Foreground"
        ):
            deleted.append(f"deployment/{name}")
    for name in jobs:
        if _delete_quietly(
            clients.batch.delete_namespaced_job, name=name, namespace=namespace, propagation_policy="Foreground"
        ):
            deleted.append(f"job/{name}")
    for name in services:
        if _delete_quietly(clients.core.delete_namespaced_service, name=name, namespace=namespace):
            deleted.append(f"service/{name}")
    return deleted


def _watch_factory() -> Any:
    from kubernetes import watch

    return watch.Watch()


def wait_gone(
    list_function: Callable[..., Any],
    namespace: str,
    selector: str,
    *,
    timeout_s: int,
    watcher_factory: Callable[[], Any] | None = None,
) -> None:
    """Block until no object matching `selector` remains (a watch, not a poll); TimeoutError after `timeout_s`."""
    remaining = {item.metadata.name for item in list_function(namespace=namespace, label_selector=selector).items}
    if not remaining:
        return
    watcher = (watcher_factory or _watch_factory)()
    for event in watcher.stream(
        list_function,
        namespace=namespace,
        label_selector=selector,
        timeout_seconds=timeout_s,
        _request_timeout=(REQUEST_TIMEOUT_S[0], timeout_s + 30),  # events may be minutes apart: not the default read
    ):
        if event["type"] == "DELETED":
            remaining.discard(event["object"].metadata.name)
        if not remaining:
            watcher.stop()
            return
    left = {item.metadata.name for item in list_function(namespace=namespace, label_selector=selector).items}
    if left:
        raise TimeoutError(f"still present after {timeout_s} s: {sorted(left)}")


def _trainjob_api(namespace: str) -> dict[str, str]:
    from mass_ops.compute.kubernetes import TRAINJOB_GROUP, TRAINJOB_PLURAL, TRAINJOB_VERSION

    return {"group": TRAINJOB_GROUP, "version": TRAINJOB_VERSION, "namespace": namespace, "plural": TRAINJOB_PLURAL}


def read_job(batch: Any, name: str, namespace: str) -> Any | None:
    """The Job `name`, or None when there is none (another API error propagates)."""
    try:
        return batch.read_namespaced_job(name=name, namespace=namespace)
    except _api_exception() as exc:
        if is_not_found(exc):
            return None
        raise


def read_trainjob(custom: Any, name: str, namespace: str) -> dict[str, Any] | None:
    """The TrainJob `name` as a dict (the custom-objects API returns plain JSON), or None when there is none."""
    api_exception = _api_exception()
    try:
        return custom.get_namespaced_custom_object(**_trainjob_api(namespace), name=name)
    except api_exception as exc:
        if is_not_found(exc):
            return None
        raise


def create_trainjob(custom: Any, manifest: dict[str, Any]) -> None:
    custom.create_namespaced_custom_object(**_trainjob_api(manifest["metadata"]["namespace"]), body=manifest)


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


def wait_trainjob_gone(
    custom: Any, name: str, namespace: str, *, timeout_s: int, watcher_factory: Callable[[], Any] | None = None
) -> None:
    """Block until the TrainJob `name` is gone (a watch, not a poll); TimeoutError after `timeout_s`."""
    if read_trainjob(custom, name, namespace) is None:
        return
    watcher = (watcher_factory or _watch_factory)()
    selector = f"metadata.name={name}"
    for event in watcher.stream(
        custom.list_namespaced_custom_object,
        **_trainjob_api(namespace),
        field_selector=selector,
        timeout_seconds=timeout_s,
    ):
        if event["type"] == "DELETED" and event["object"]["metadata"]["name"] == name:
            watcher.stop()
            return
    if read_trainjob(custom, name, namespace) is not None:
        raise TimeoutError(f"TrainJob {name} still present after {timeout_s} s")


def delete_selected(clients: KubeClients, namespace: str, selector: str, *, timeout_s: int = 600) -> list[str]:
    """Delete every Deployment and Service matching `selector` and wait until they are gone.

    Listing by label (not by name) also removes servers a previous attempt created under a different spec.
    """
    deployments = [
        d.metadata.name for d in clients.apps.list_namespaced_deployment(namespace, label_selector=selector).items
    ]
    services = [s.metadata.name for s in clients.core.list_namespaced_service(namespace, label_selector=selector).items]
    deleted = delete_objects(clients, namespace, deployments=deployments, services=services)
    wait_gone(clients.apps.list_namespaced_deployment, namespace, selector, timeout_s=timeout_s)
    wait_gone(clients.core.list_namespaced_service, namespace, selector, timeout_s=timeout_s)
    return deleted


def _age_s(timestamp: Any, now: datetime | None) -> float:
    if timestamp is None:
        return 0.0
    now = now or datetime.now(tz=UTC)
    if timestamp.tzinfo is None:
        timestamp = timestamp.replace(tzinfo=UTC)
    return (now - timestamp).total_seconds()


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


def pods_problem(
    core: Any, namespace: str, selector: str, *, schedule_timeout_s: float, now: datetime | None = None
) -> str | None:
    """The first fatal problem among the pods matching `selector`, or None."""
    for pod in core.list_namespaced_pod(namespace=namespace, label_selector=selector).items:
        problem = pod_problem(pod, schedule_timeout_s=schedule_timeout_s, now=now)
        if problem:
            return problem
    return None


def log_tail(core: Any, name: str, namespace: str, *, container: str = "base", lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a container's log, or a note saying why there is none."""
    api_exception = _api_exception()
    try:
        text = core.read_namespaced_pod_log(name=name, namespace=namespace, container=container, tail_lines=lines)
    except api_exception as exc:
        return f"(log of {name} unavailable: {getattr(exc, 'reason', exc)})"
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return str(text).rstrip() or f"(log of {name} is empty)"


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


def failed_pod_tails(core: Any, namespace: str, selector: str, *, lines: int = LOG_TAIL_LINES) -> str:
    """Log tails of the pods that failed among those matching `selector` (all pods when none is marked failed)."""
    pods = core.list_namespaced_pod(namespace=namespace, label_selector=selector).items
    failed = [p for p in pods if p.status is not None and p.status.phase == "Failed"] or list(pods)
    parts = []
    for pod in failed:
        tail = log_tail(core, pod.metadata.name, namespace, lines=lines)
        parts.append(f"--- {pod.metadata.name} (last {lines} lines) ---\n{tail}")
    return "\n".join(parts) if parts else "(no pods found)"
