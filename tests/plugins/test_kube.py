"""The Kubernetes clients mass-ops operators use never wait forever: an API server that accepts a connection and never
answers fails the call within the default request timeout, while a call's own timeout (a watch's) still wins."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from kubernetes import client
from mass_ops_airflow import kube


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


def api_client(host: str) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = host
    configuration.retries = False  # one try, so the failure comes after one timeout
    return client.ApiClient(configuration)


def test_a_call_without_its_own_timeout_gets_the_default_one(silent_api_server: str) -> None:
    core = client.CoreV1Api(kube.with_request_timeout(api_client(silent_api_server), (0.5, 0.5)))
    started = time.monotonic()
    with pytest.raises(Exception, match=r"(?i)timed? ?out"):
        core.read_namespaced_pod(name="p", namespace="ns")
    assert time.monotonic() - started < 30, "the call was bounded (the client's own default is to wait forever)"


def test_a_call_s_own_timeout_wins_over_the_default() -> None:
    seen: list[object] = []

    class Rest:
        def request(self, *args: object, _request_timeout: object = None, **kwargs: object) -> None:
            seen.append(_request_timeout)

    holder = type("ApiClient", (), {})()
    holder.rest_client = Rest()
    kube.with_request_timeout(holder, (1.0, 2.0))
    holder.rest_client.request("GET", "http://x")
    holder.rest_client.request("GET", "http://x", _request_timeout=(1.0, 330.0))
    assert seen == [(1.0, 2.0), (1.0, 330.0)]
