"""A stand-in for the Kubernetes API: one namespace in memory, every call recorded as (API group, resource, verb).

There is no cluster here. This fake implements the CoreV1/AppsV1/BatchV1 methods the mass-ops operators and the
provider's pod operator call, and the CustomObjectsApi methods for Kubeflow TrainJobs; it returns real
`kubernetes.client` model objects (so provider code reading `.status.phase` and friends works unchanged), plain
dicts for custom objects as that API does, raises the client's own `ApiException` for missing objects, and models
foreground deletion (a deleted Deployment/Job/Service/TrainJob stays listed until a watch observes its DELETED
event). The recorded calls are what the RBAC test compares with the Helm chart's Role. The clients `MassKubeHook`
gets (`hook_clients`) also record each call's `_request_timeout`, so a test can tell that every call was bounded.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kubernetes.client import ApiClient, Configuration
from kubernetes.client.exceptions import ApiException


def _api_client() -> ApiClient:
    # Partial objects are fine here (tests write only the fields under test); the real API validates server-side.
    configuration = Configuration()
    configuration.client_side_validation = False
    return ApiClient(configuration=configuration)


_API = _api_client()

KINDS = {
    "pods": ("", "V1Pod"),
    "services": ("", "V1Service"),
    "deployments": ("apps", "V1Deployment"),
    "jobs": ("batch", "V1Job"),
    "trainjobs": ("trainer.kubeflow.org", ""),  # a custom resource: the API returns plain dicts
}
TRAINJOB_API = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")


def to_model(manifest: dict[str, Any], model: str) -> Any:
    """A dict manifest as the client's model object (as the API would return it)."""
    response = SimpleNamespace(data=json.dumps(manifest, default=str))
    return _API.deserialize(response, model)


def matches(labels: dict[str, str], selector: str | None) -> bool:
    """Kubernetes equality-based label selector: `k=v`, `k!=v`, `k`, `!k`, comma-separated."""
    if not selector:
        return True
    for term in selector.split(","):
        term = term.strip()
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.rstrip("=")) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class FakeCluster:
    """One namespace's objects (as dicts), pod logs, events, and the log of API calls."""

    objects: dict[str, dict[str, dict[str, Any]]] = field(default_factory=lambda: {k: {} for k in KINDS})
    terminating: dict[str, set[str]] = field(default_factory=lambda: {k: set() for k in KINDS})
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)
    default_log: str = ""  # the log of any pod without its own entry (pod names carry random suffixes)
    events: list[dict[str, Any]] = field(default_factory=list)
    # What a newly created pod looks like when read back: phase and the base container's exit code.
    pod_outcome: tuple[str, int | None] = ("Succeeded", 0)
    # Job status written when a Job is created: None (running), "Complete" or "Failed".
    job_outcome: str | None = None
    # What the workload does when its pod is created (e.g. record its episode in the metadata store).
    on_pod_created: Any = None
    # (client method, its `_request_timeout`) of every call made through `hook_clients` (None: the call set none).
    timeouts: list[tuple[str, Any]] = field(default_factory=list)

    def record(self, kind: str, verb: str, subresource: str = "") -> None:
        group = KINDS[kind][0]
        self.calls.append((group, f"{kind}/{subresource}" if subresource else kind, verb))

    def verbs(self) -> dict[tuple[str, str], set[str]]:
        used: dict[tuple[str, str], set[str]] = {}
        for group, resource, verb in self.calls:
            used.setdefault((group, resource), set()).add(verb)
        return used

    # -- generic object handling -------------------------------------------------------------------------------

    def _get(self, kind: str, name: str) -> dict[str, Any]:
        if name not in self.objects[kind]:
            raise ApiException(status=404, reason="Not Found")
        return self.objects[kind][name]

    def model(self, kind: str, manifest: dict[str, Any]) -> Any:
        if not KINDS[kind][1]:
            return json.loads(json.dumps(manifest))
        return to_model(manifest, KINDS[kind][1])

    def create(self, kind: str, body: Any) -> Any:
        manifest = body if isinstance(body, dict) else _API.sanitize_for_serialization(body)
        manifest = json.loads(json.dumps(manifest, default=str))
        name = manifest["metadata"]["name"]
        if name in self.objects[kind]:
            raise ApiException(status=409, reason="AlreadyExists")
        manifest["metadata"].setdefault("creationTimestamp", dt.datetime.now(dt.UTC).isoformat())
        if kind == "pods":
            manifest["status"] = self._pod_status(manifest)
            if self.on_pod_created is not None:
                self.on_pod_created(manifest)
        if kind == "jobs" and self.job_outcome:
            manifest["status"] = {"conditions": [{"type": self.job_outcome, "status": "True", "reason": "Fake"}]}
        self.objects[kind][name] = manifest
        return self.model(kind, manifest)

    def _pod_status(self, manifest: dict[str, Any]) -> dict[str, Any]:
        phase, code = self.pod_outcome
        status: dict[str, Any] = {"phase": phase}
        container = manifest["spec"]["containers"][0]["name"]
        if code is not None:
            terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}
            status["containerStatuses"] = [
                {"name": container, "ready": False, "restartCount": 0, "image": "i", "imageID": "",
                 "state": {"terminated": terminated}},
            ]  # fmt: skip
        return status

    def delete(self, kind: str, name: str, *, foreground: bool) -> None:
        self._get(kind, name)
        if foreground:
            self.terminating[kind].add(name)
        else:
            del self.objects[kind][name]

    def listing(self, kind: str, selector: str | None) -> list[dict[str, Any]]:
        return [m for m in self.objects[kind].values() if matches(m["metadata"].get("labels") or {}, selector)]

    def list_call(self, kind: str, label_selector: str | None = None, watch: bool = False, **_: Any) -> Any:
        self.record(kind, "watch" if watch else "list")
        if watch:
            return self._watch_events(kind, label_selector)
        return SimpleNamespace(items=[self.model(kind, m) for m in self.listing(kind, label_selector)])

    def _watch_events(self, kind: str, selector: str | None) -> Iterator[dict[str, Any]]:
        for manifest in self.listing(kind, selector):
            name = manifest["metadata"]["name"]
            if name in self.terminating[kind]:
                del self.objects[kind][name]
                self.terminating[kind].discard(name)
                yield {"type": "DELETED", "object": self.model(kind, manifest)}

    # -- clients -------------------------------------------------------------------------------------------------

    @property
    def core(self) -> FakeCoreV1:
        return FakeCoreV1(self)

    @property
    def apps(self) -> FakeAppsV1:
        return FakeAppsV1(self)

    @property
    def batch(self) -> FakeBatchV1:
        return FakeBatchV1(self)

    @property
    def custom(self) -> FakeCustomObjects:
        return FakeCustomObjects(self)

    def hook_clients(self) -> dict[str, Any]:
        """`MassKubeHook`'s client attributes, each a `TimedClient` over this namespace."""
        return {
            "core_v1_client": TimedClient(self.core, self.timeouts),
            "apps_v1_client": TimedClient(self.apps, self.timeouts),
            "batch_v1_client": TimedClient(self.batch, self.timeouts),
            "custom_object_client": TimedClient(self.custom, self.timeouts),
        }

    def untimed_calls(self) -> list[str]:
        """The calls made through `hook_clients` without a `_request_timeout`."""
        return [method for method, timeout in self.timeouts if timeout is None]

    def set_trainjob_condition(self, name: str, condition: str, message: str = "") -> None:
        """Test helper: the Trainer controller's verdict on a TrainJob."""
        trainjob = self._get("trainjobs", name)
        trainjob["status"] = {
            "conditions": [{"type": condition, "status": "True", "reason": condition, "message": message}]
        }

    def watcher(self) -> FakeWatch:
        return FakeWatch()


class TimedClient:
    """A fake API client whose every method call appends (method, `_request_timeout` or None) to `timeouts`."""

    def __init__(self, inner: Any, timeouts: list[tuple[str, Any]]) -> None:
        self._inner = inner
        self._timeouts = timeouts

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            self._timeouts.append((name, kwargs.get("_request_timeout")))
            return attribute(*args, **kwargs)

        # `kubernetes.watch.Watch` reads the list function's name to find its return type.
        call.__name__ = name
        return call


class FakeWatch:
    """`kubernetes.watch.Watch` over the fake: `stream(list_fn, ...)` calls it with watch=True."""

    def stream(self, function: Any, *args: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
        kwargs.pop("timeout_seconds", None)
        yield from function(*args, watch=True, **kwargs)

    def stop(self) -> None:
        pass


class FakeCoreV1:
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.api_client = _API  # PodManager.create_pod sanitizes through it

    # pods
    def create_namespaced_pod(self, namespace: str, body: Any, **_: Any) -> Any:
        self.cluster.record("pods", "create")
        return self.cluster.create("pods", body)

    def read_namespaced_pod(self, name: str, namespace: str, **_: Any) -> Any:
        self.cluster.record("pods", "get")
        return self.cluster.model("pods", self.cluster._get("pods", name))

    def list_namespaced_pod(self, namespace: str, label_selector: str | None = None, **kwargs: Any) -> Any:
        return self.cluster.list_call("pods", label_selector, **kwargs)

    def delete_namespaced_pod(self, name: str, namespace: str, **_: Any) -> None:
        self.cluster.record("pods", "delete")
        self.cluster.delete("pods", name, foreground=False)

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict[str, Any], **_: Any) -> Any:
        self.cluster.record("pods", "patch")
        pod = self.cluster._get("pods", name)
        pod["metadata"].setdefault("labels", {}).update(body.get("metadata", {}).get("labels", {}))
        return self.cluster.model("pods", pod)

    def read_namespaced_pod_log(self, name: str, namespace: str, tail_lines: int | None = None, **kwargs: Any) -> Any:
        self.cluster.record("pods", "get", "log")
        self.cluster._get("pods", name)
        lines = self.cluster.logs.get(name, self.cluster.default_log).splitlines()
        if tail_lines:
            lines = lines[-tail_lines:]
        if kwargs.get("_preload_content") is False:
            return iter([f"{line}\n".encode() for line in lines])
        return "\n".join(lines)

    def list_namespaced_event(self, namespace: str, **_: Any) -> Any:
        self.cluster.calls.append(("", "events", "list"))
        return SimpleNamespace(items=[SimpleNamespace(**e) for e in self.cluster.events])

    # services
    def create_namespaced_service(self, namespace: str, body: Any, **_: Any) -> Any:
        self.cluster.record("services", "create")
        return self.cluster.create("services", body)

    def read_namespaced_service(self, name: str, namespace: str, **_: Any) -> Any:
        self.cluster.record("services", "get")
        return self.cluster.model("services", self.cluster._get("services", name))

    def list_namespaced_service(self, namespace: str, label_selector: str | None = None, **kwargs: Any) -> Any:
        return self.cluster.list_call("services", label_selector, **kwargs)

    def delete_namespaced_service(self, name: str, namespace: str, **_: Any) -> None:
        self.cluster.record("services", "delete")
        self.cluster.delete("services", name, foreground=True)


class FakeAppsV1:
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster

    def create_namespaced_deployment(self, namespace: str, body: Any, **_: Any) -> Any:
        self.cluster.record("deployments", "create")
        return self.cluster.create("deployments", body)

    def read_namespaced_deployment(self, name: str, namespace: str, **_: Any) -> Any:
        self.cluster.record("deployments", "get")
        return self.cluster.model("deployments", self.cluster._get("deployments", name))

    def patch_namespaced_deployment(self, name: str, namespace: str, body: dict[str, Any], **_: Any) -> Any:
        self.cluster.record("deployments", "patch")
        self.cluster._get("deployments", name)
        self.cluster.objects["deployments"][name] = json.loads(json.dumps(body))
        return self.cluster.model("deployments", body)

    def list_namespaced_deployment(self, namespace: str, label_selector: str | None = None, **kwargs: Any) -> Any:
        return self.cluster.list_call("deployments", label_selector, **kwargs)

    def delete_namespaced_deployment(self, name: str, namespace: str, propagation_policy: str | None = None, **_: Any):
        self.cluster.record("deployments", "delete")
        self.cluster.delete("deployments", name, foreground=propagation_policy == "Foreground")


class FakeBatchV1:
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster

    def create_namespaced_job(self, namespace: str, body: Any, **_: Any) -> Any:
        self.cluster.record("jobs", "create")
        return self.cluster.create("jobs", body)

    def read_namespaced_job(self, name: str, namespace: str, **_: Any) -> Any:
        self.cluster.record("jobs", "get")
        return self.cluster.model("jobs", self.cluster._get("jobs", name))

    def read_namespaced_job_status(self, name: str, namespace: str, **_: Any) -> Any:
        self.cluster.record("jobs", "get", "status")
        return self.cluster.model("jobs", self.cluster._get("jobs", name))

    def list_namespaced_job(self, namespace: str, label_selector: str | None = None, **kwargs: Any) -> Any:
        return self.cluster.list_call("jobs", label_selector, **kwargs)

    def delete_namespaced_job(self, name: str, namespace: str, propagation_policy: str | None = None, **_: Any):
        self.cluster.record("jobs", "delete")
        self.cluster.delete("jobs", name, foreground=propagation_policy == "Foreground")

    def set_job_condition(self, name: str, condition: str, message: str = "") -> None:
        """Test helper: the Job controller's verdict."""
        job = self.cluster._get("jobs", name)
        job["status"] = {"conditions": [{"type": condition, "status": "True", "reason": condition, "message": message}]}


class FakeCustomObjects:
    """CustomObjectsApi for the one custom resource mass-ops uses: Kubeflow TrainJobs."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster

    @staticmethod
    def _check(group: str, version: str, plural: str) -> None:
        if (group, version, plural) != TRAINJOB_API:
            raise ApiException(status=404, reason=f"the fake serves no {group}/{version} {plural}")

    def create_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, body: Any, **_: Any
    ) -> Any:
        self._check(group, version, plural)
        self.cluster.record("trainjobs", "create")
        return self.cluster.create("trainjobs", body)

    def get_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str, **_: Any
    ) -> Any:
        self._check(group, version, plural)
        self.cluster.record("trainjobs", "get")
        return self.cluster.model("trainjobs", self.cluster._get("trainjobs", name))

    def list_namespaced_custom_object(
        self,
        group: str,
        version: str,
        namespace: str,
        plural: str,
        label_selector: str | None = None,
        field_selector: str | None = None,
        watch: bool = False,
        **_: Any,
    ) -> Any:
        self._check(group, version, plural)
        self.cluster.record("trainjobs", "watch" if watch else "list")
        # The one field selector the operators use: metadata.name=<name>.
        name = field_selector.removeprefix("metadata.name=") if field_selector else None
        if watch:
            events = self.cluster._watch_events("trainjobs", label_selector)
            return (event for event in events if name in (None, event["object"]["metadata"]["name"]))
        listed = self.cluster.listing("trainjobs", label_selector)
        return {"items": [self.cluster.model("trainjobs", m) for m in listed if name in (None, m["metadata"]["name"])]}

    def delete_namespaced_custom_object(
        self,
        group: str,
        version: str,
        namespace: str,
        plural: str,
        name: str,
        propagation_policy: str | None = None,
        **_: Any,
    ) -> None:
        self._check(group, version, plural)
        self.cluster.record("trainjobs", "delete")
        self.cluster.delete("trainjobs", name, foreground=propagation_policy == "Foreground")
