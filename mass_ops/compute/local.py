"""The local-process backend: a detached model server with a state file, and commands run as local processes.

The embedded profile serves the current model with `transformers serve` on CPU. The server must outlive the process
that starts it (an Airflow setup task ends once the server is ready; the teardown task, in another process, stops
it), so it runs in its own session and its identity — pid, process group, argv, endpoint — is kept in a JSON state
file written atomically. Starting again with the same argv reuses a live server; stopping is idempotent.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from mass_ops.compute.processes import proc_stat, signal_group, start_in_session, stop_group
from mass_ops.compute.readiness import probe
from mass_ops.errors import InfrastructureError


class LocalServerError(InfrastructureError):
    """The local model server could not be started, did not become ready, or died; the message says which."""


class LocalCommandError(InfrastructureError):
    """A local command exited non-zero; carries its exit code and the tail of its output."""

    def __init__(self, argv: Sequence[str], returncode: int, tail: str) -> None:
        self.returncode = returncode
        self.tail = tail
        super().__init__(f"{argv[0]} exited with status {returncode}; last output:\n{tail}")


@dataclass(frozen=True)
class ServerState:
    """What the state file records about a started server."""

    pid: int
    pgid: int
    argv: list[str]
    endpoint: str
    served_name: str
    log_path: str
    started_at: float
    start_ticks: int | None = None  # kernel start time of the process: tells our server from a reused pid


@dataclass(frozen=True)
class CommandResult:
    """A finished local command: exit status and the last lines of its combined output."""

    returncode: int
    tail: str


def transformers_serve_argv(model: str, *, port: int, host: str = "127.0.0.1", extra: Sequence[str] = ()) -> list[str]:
    """`transformers serve MODEL --host H --port P` (pinned to one model, which `/v1/models` then lists alone)."""
    script = Path(sys.executable).with_name("transformers")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "transformers.cli.transformers"]
    return [*head, "serve", model, "--host", host, "--port", str(port), *extra]


# Where the local backend records the model servers it starts (relative to the working directory, like runs/).
SERVERS_DIR = Path("runs") / "servers"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (the OS picks it; a server started right after can bind it)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(text, encoding="utf-8")
    os.replace(temp, path)


def read_state(state_file: str | Path) -> ServerState | None:
    """The recorded server, or None when there is no (readable) state file."""
    path = Path(state_file)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return ServerState(**data)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as exc:
        raise LocalServerError(
            f"server state file {path} is unreadable ({exc}); remove it after stopping the server"
        ) from None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) from /proc/<pid>/stat; None without /proc or process."""
    stat = proc_stat(pid)
    return None if stat is None else (stat[0], stat[2])


def is_alive(state: ServerState) -> bool:
    """Whether the recorded process still runs, and is still our server (pids are reused)."""
    try:
        os.kill(state.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # a pid owned by someone else is not our server
    stat = _proc_stat(state.pid)
    if stat is None:  # no /proc (macOS): the signal check is all there is
        return True
    letter, ticks = stat
    if letter in ("Z", "X"):
        return False
    return state.start_ticks is None or ticks == state.start_ticks


def log_tail(path: str | Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file ('' when it does not exist)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return "".join(deque(handle, maxlen=lines)).rstrip()
    except FileNotFoundError:
        return ""


def start_server(
    argv: Sequence[str],
    *,
    state_file: str | Path,
    endpoint: str,
    served_name: str,
    log_path: str | Path,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> ServerState:
    """Start `argv` detached (own session, output to `log_path`) and record it; reuse a live identical server.

    A live server recorded with another argv is refused: stop it first (two servers cannot share the port).
    """
    argv = list(argv)
    existing = read_state(state_file)
    if existing is not None and is_alive(existing):
        if existing.argv == argv:
            return existing
        raise LocalServerError(
            f"a different server (pid {existing.pid}, {' '.join(existing.argv[-6:])}) is recorded in {state_file}; "
            "stop it before starting another"
        )
    log = Path(log_path)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        try:
            # Its own session: it survives the starting process, and its process group is stopped as one.
            process = start_in_session(argv, stdout=out, env=env, cwd=cwd)
        except OSError as exc:
            raise LocalServerError(f"cannot start {argv[0]}: {exc}") from None
    stat = _proc_stat(process.pid)
    state = ServerState(
        pid=process.pid,
        pgid=os.getpgid(process.pid),
        argv=argv,
        endpoint=endpoint,
        served_name=served_name,
        log_path=str(log),
        started_at=time.time(),
        start_ticks=stat[1] if stat else None,
    )
    _write_atomic(Path(state_file), json.dumps(asdict(state), indent=2))
    return state


def wait_ready(
    state: ServerState,
    *,
    timeout_s: float,
    interval_s: float = 0.25,
    api_key_env: str | None = None,
) -> None:
    """Block until the server is ready (see `mass_ops.compute.readiness`); raise if it dies or times out. A probe of
    a server still starting is a refused connection: polling often costs nothing and finds it ready sooner."""
    deadline = time.monotonic() + timeout_s
    problem = "not probed yet"
    while True:
        if not is_alive(state):
            raise LocalServerError(
                f"model server (pid {state.pid}) exited before it was ready; log tail:\n{log_tail(state.log_path)}"
            )
        # The smoke generation may not outlast the caller's deadline (a model that loads on first use can be slow).
        remaining = max(1.0, deadline - time.monotonic())
        report = probe(state.endpoint, state.served_name, api_key_env=api_key_env, smoke_timeout_s=remaining)
        if report.ready:
            return
        problem = report.problem or problem
        if time.monotonic() >= deadline:
            raise LocalServerError(
                f"model server at {state.endpoint} not ready after {timeout_s:g} s: {problem}; log tail:\n"
                f"{log_tail(state.log_path)}"
            )
        time.sleep(interval_s)


def stop_server(state_file: str | Path, *, grace_s: float = 30.0) -> bool:
    """Stop the recorded server (SIGTERM to its process group, SIGKILL after `grace_s`) and remove the state file.

    Returns whether a live server was stopped; no state file or a dead server is not an error.
    """
    path = Path(state_file)
    state = read_state(path)
    if state is None:
        return False
    stopped = False
    if is_alive(state):
        # Judged by `is_alive` (the recorded start time), not the group: the pid may belong to another process now.
        stop_group(state.pgid, grace_s=grace_s, running=lambda: is_alive(state), leader=state.pid)
        stopped = True
    path.unlink(missing_ok=True)
    return stopped


def run_command(
    argv: Sequence[str],
    *,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    tail_lines: int = 40,
    check: bool = True,
) -> CommandResult:
    """Run `argv` as a local process and wait; raise `LocalCommandError` with the output tail on a non-zero exit.

    A timeout kills the whole process group (the command's own children included) and raises TimeoutError.
    """
    argv = list(argv)
    tail: deque[str] = deque(maxlen=tail_lines)
    process = start_in_session(argv, stdout=subprocess.PIPE, env=env, cwd=cwd, text=True)
    assert process.stdout is not None
    stream = process.stdout
    # A reader thread drains the pipe so a chatty command never blocks on it while we wait with a timeout.
    reader = threading.Thread(target=lambda: tail.extend(line.rstrip("\n") for line in stream), daemon=True)
    reader.start()
    try:
        returncode = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        signal_group(process.pid, signal.SIGKILL)
        process.wait()
        raise TimeoutError(f"{argv[0]} did not finish within {timeout_s:g} s") from None
    finally:
        reader.join(timeout=5)
        stream.close()
    result = CommandResult(returncode, "\n".join(tail))
    if check and returncode != 0:
        raise LocalCommandError(argv, returncode, result.tail)
    return result
