"""Fixtures of the store tests: a TCP server that accepts connections and never answers (a hung database or S3
endpoint), and store timeouts small enough that tests of it finish in seconds."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from mass_ops.store import timeouts
from tests.support.store import SilentServer

SMALL_TIMEOUT_S = "2"  # libpq's smallest connect timeout


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    """A server on 127.0.0.1 that completes every TCP handshake, reads nothing and never sends a byte.

    Listening before the fixture returns makes it ready (the kernel completes handshakes from the backlog); the
    acceptor thread only keeps accepted sockets open, and everything is closed at teardown.
    """
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    listener.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(connection)

    thread = threading.Thread(target=accept, name="silent-server", daemon=True)
    thread.start()
    try:
        yield SilentServer("127.0.0.1", listener.getsockname()[1])
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
        for connection in accepted:
            connection.close()


@pytest.fixture
def small_store_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Store timeouts of 2 s and one attempt per request, through the documented environment variables."""
    monkeypatch.setenv(timeouts.CONNECT_TIMEOUT_ENV, SMALL_TIMEOUT_S)
    monkeypatch.setenv(timeouts.READ_TIMEOUT_ENV, SMALL_TIMEOUT_S)
    monkeypatch.setenv(timeouts.MAX_ATTEMPTS_ENV, "1")


@pytest.fixture
def fake_s3_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy credentials and a region, and no AWS variable of the machine that could point boto3 elsewhere."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret-key")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
