"""`MassKubeHook` never waits forever: every call it makes passes a request timeout (a watch its own, longer one), so
an API server that accepts a connection and never answers fails the call; and it takes its cluster from the Airflow
Kubernetes connection the way the provider's hook does, owning one set of clients."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from mass_ops_airflow.kube import REQUEST_TIMEOUT_S, WATCH_READ_MARGIN_S, MassKubeHook

from tests.plugins.kube_fakes import FakeCluster


@pytest.fixture
def silent_api_server() -> Iterator[str]:
    """A TCP server that accepts connections and never sends a byte (the bound socket exists before any client)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    for connection in held:
        connection.close()
    server.close()


def kubeconfig(server: str) -> dict[str, object]:
    """A kubeconfig naming one cluster at `server`, with no credentials."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }


def use_connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, server: str) -> None:
    """An Airflow Kubernetes connection `conn_id` (from the environment) whose kubeconfig points at `server`."""
    connection = {"conn_type": "kubernetes", "extra": {"kube_config": json.dumps(kubeconfig(server))}}
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(connection))


def test_a_hung_api_server_fails_the_call_within_the_request_timeout(silent_api_server, monkeypatch):
    use_connection(monkeypatch, "mass_k8s", silent_api_server)
    hook = MassKubeHook("mass_k8s", request_timeout=(0.5, 0.5))
    started = time.monotonic()
    with pytest.raises(Exception, match=r"(?i)timed? ?out"):
        hook.read_pod("p", "ns")
    # The provider's own default is a 60 s read (each retry included): 0.5 s reads end well before that.
    assert time.monotonic() - started < 20


def test_the_hook_takes_its_cluster_from_the_named_connection(monkeypatch):
    use_connection(monkeypatch, "mass_k8s", "https://api.example.test:6443")
    hook = MassKubeHook("mass_k8s")
    assert hook.conn_id == "mass_k8s" and hook.request_timeout == REQUEST_TIMEOUT_S
    assert hook.api_client.configuration.host == "https://api.example.test:6443"
    assert hook.is_in_cluster is False


def test_the_hook_owns_one_set_of_clients_over_one_api_client(monkeypatch):
    use_connection(monkeypatch, "mass_k8s", "https://api.example.test:6443")
    hook = MassKubeHook("mass_k8s")
    clients = [hook.core_v1_client, hook.apps_v1_client, hook.batch_v1_client, hook.custom_object_client]
    assert all(client.api_client is hook.api_client for client in clients)
    assert hook.core_v1_client is hook.core_v1_client, "created once, then reused"
    assert MassKubeHook("mass_k8s").api_client is not hook.api_client, "each hook has its own"


def test_without_a_connection_id_the_hook_uses_the_provider_default():
    assert MassKubeHook().conn_id == MassKubeHook.default_conn_name == "kubernetes_default"
    assert MassKubeHook.conn_name_attr == "kubernetes_conn_id" and MassKubeHook.conn_type == "kubernetes"
    assert MassKubeHook(in_cluster=True).in_cluster is True, "the provider's options pass through"


def manifest(name: str, **extra: object) -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": "mass-ops", "labels": {"app": name}}, "spec": {}, **extra}


def exercise_every_call(hook: MassKubeHook, cluster: FakeCluster) -> None:
    """Every public method of the hook once, including both watches (objects that go away while watched)."""
    pod = manifest("p", spec={"containers": [{"name": "base", "image": "i"}]})
    hook.start_pod(pod)
    assert hook.read_pod("p", "mass-ops") is not None and hook.read_pod("gone", "mass-ops") is None
    assert [p.metadata.name for p in hook.list_pods("mass-ops", "app=p")] == ["p"]
    cluster.logs["p"] = "one\ntwo"
    assert hook.read_pod_log("p", "mass-ops", container="base") == "one\ntwo"
    assert hook.log_tail("p", "mass-ops", lines=1) == "two"
    assert "--- p (last 40 lines) ---" in hook.failed_pod_tails("mass-ops", "app=p")
    assert hook.pods_problem("mass-ops", "app=p", schedule_timeout_s=60) is None
    assert hook.delete_pod("p", "mass-ops") and not hook.delete_pod("p", "mass-ops")

    hook.start_job(manifest("j", spec={"template": {"spec": {"containers": []}}}))
    assert hook.read_job("j", "mass-ops") is not None and hook.get_job("j", "mass-ops") is not None
    assert hook.delete_objects("mass-ops", jobs=["j"]) == ["job/j"]
    hook.wait_jobs_gone("mass-ops", "app=j", timeout_s=5)

    hook.start_trainjob(manifest("t"))
    assert hook.read_trainjob("t", "mass-ops") is not None
    assert hook.delete_objects("mass-ops", trainjobs=["t"]) == ["trainjob/t"]
    hook.wait_trainjob_gone("t", "mass-ops", timeout_s=5)

    assert hook.apply_deployment(manifest("d")) == "created" and hook.apply_deployment(manifest("d")) == "patched"
    assert hook.ensure_service(manifest("d")) == "created" and hook.ensure_service(manifest("d")) == "exists"
    assert hook.delete_selected("mass-ops", "app=d", timeout_s=5) == ["deployment/d", "service/d"]
    assert cluster.objects["deployments"] == {} and cluster.objects["services"] == {}


@pytest.mark.parametrize("request_timeout", [REQUEST_TIMEOUT_S, (1.0, 2.0)])
def test_every_call_passes_the_request_timeout_and_a_watch_its_own(cluster, request_timeout):
    exercise_every_call(MassKubeHook(request_timeout=request_timeout), cluster)
    watch_timeout = (request_timeout[0], 5 + WATCH_READ_MARGIN_S)
    watches = [method for method, timeout in cluster.timeouts if timeout == watch_timeout]
    assert watches == [
        "list_namespaced_job",
        "list_namespaced_custom_object",
        "list_namespaced_deployment",
        "list_namespaced_service",
    ]
    others = {timeout for _, timeout in cluster.timeouts if timeout != watch_timeout}
    assert others == {request_timeout}, "every other call: the hook's request timeout, never none"
    assert len(cluster.timeouts) > 25
