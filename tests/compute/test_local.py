"""The local-process backend: a detached server with a state file, readiness, idempotent stop, local commands."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from mass_ops.compute.local import (
    LocalCommandError,
    LocalServerError,
    is_alive,
    read_state,
    run_command,
    start_server,
    stop_server,
    transformers_serve_argv,
    wait_ready,
)

STUB = Path(__file__).with_name("model_server_stub.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan may wait for a reaper that a container's PID 1 never is)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return "Z" not in state.split()[1]


def stub_argv(port: int, name: str, *extra: str) -> list[str]:
    return [sys.executable, str(STUB), "--port", str(port), "--name", name, *extra]


@pytest.fixture
def server_files(tmp_path):
    state = tmp_path / "state" / "server.json"
    yield state, tmp_path / "server.log"
    stop_server(state, grace_s=5)  # never leave a process behind, whatever the test did


def test_start_wait_reuse_and_stop(server_files):
    state_file, log = server_files
    port = free_port()
    argv = stub_argv(port, "mass-tiny-L0")
    endpoint = f"http://127.0.0.1:{port}/v1"
    state = start_server(argv, state_file=state_file, endpoint=endpoint, served_name="mass-tiny-L0", log_path=log)
    wait_ready(state, timeout_s=30, interval_s=0.2)
    assert read_state(state_file) == state and is_alive(state)

    # Same argv: the live server is reused (a re-run setup task does not start a second one).
    again = start_server(argv, state_file=state_file, endpoint=endpoint, served_name="mass-tiny-L0", log_path=log)
    assert again.pid == state.pid
    # Another argv while it runs: refused, naming the state file.
    with pytest.raises(LocalServerError, match="different server"):
        start_server(stub_argv(port, "other"), state_file=state_file, endpoint=endpoint, served_name="o", log_path=log)

    assert stop_server(state_file, grace_s=5) is True
    assert not is_alive(state)
    assert not state_file.exists()
    assert stop_server(state_file) is False  # idempotent


def test_server_that_dies_fails_with_its_log_tail(server_files):
    state_file, log = server_files
    port = free_port()
    state = start_server(
        stub_argv(port, "x", "--no-such-flag"),
        state_file=state_file,
        endpoint=f"http://127.0.0.1:{port}/v1",
        served_name="x",
        log_path=log,
    )
    with pytest.raises(LocalServerError, match="exited before it was ready") as caught:
        wait_ready(state, timeout_s=30, interval_s=0.2)
    assert "unrecognized arguments: --no-such-flag" in str(caught.value)


def test_wrong_served_name_times_out_with_the_reason(server_files):
    state_file, log = server_files
    port = free_port()
    state = start_server(
        stub_argv(port, "actually-served"),
        state_file=state_file,
        endpoint=f"http://127.0.0.1:{port}/v1",
        served_name="expected-name",
        log_path=log,
    )
    started = time.monotonic()
    with pytest.raises(LocalServerError, match=r"not ready after 2 s: /v1/models lists \['actually-served'\]"):
        wait_ready(state, timeout_s=2, interval_s=0.2)
    assert time.monotonic() - started < 15


def test_a_server_that_lists_the_model_but_cannot_generate_is_not_ready(server_files):
    state_file, log = server_files
    port = free_port()
    state = start_server(
        stub_argv(port, "L1", "--broken-generation"),
        state_file=state_file,
        endpoint=f"http://127.0.0.1:{port}/v1",
        served_name="L1",
        log_path=log,
    )
    with pytest.raises(LocalServerError, match=r"not ready after 2 s: smoke generation answered HTTP 500: CUDA error"):
        wait_ready(state, timeout_s=2, interval_s=0.2)


def test_corrupt_state_file_is_reported(tmp_path):
    state_file = tmp_path / "server.json"
    state_file.write_text("{not json")
    with pytest.raises(LocalServerError, match="unreadable"):
        read_state(state_file)


def test_run_command_returns_the_tail_and_raises_on_failure(tmp_path):
    ok = run_command([sys.executable, "-c", "for i in range(100): print(i)"], tail_lines=3)
    assert ok.returncode == 0 and ok.tail == "97\n98\n99"
    with pytest.raises(LocalCommandError) as caught:
        run_command([sys.executable, "-c", "import sys; print('boom'); sys.exit(7)"], cwd=tmp_path)
    assert caught.value.returncode == 7 and "boom" in caught.value.tail
    quiet = run_command([sys.executable, "-c", "import sys; sys.exit(3)"], check=False)
    assert quiet.returncode == 3


def test_run_command_timeout_kills_the_whole_group(tmp_path):
    marker = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(marker)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    with pytest.raises(TimeoutError, match="did not finish within 2 s"):
        run_command([sys.executable, "-c", script], timeout_s=2)
    child = int(marker.read_text())
    deadline = time.monotonic() + 5
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(child), "the command's child survived the timeout"


def test_transformers_serve_argv_pins_one_model():
    argv = transformers_serve_argv("/models/L0-bf16", port=8011, extra=["--device", "cpu"])
    assert argv[argv.index("serve") :] == [
        "serve", "/models/L0-bf16", "--host", "127.0.0.1", "--port", "8011", "--device", "cpu",
    ]  # fmt: skip
