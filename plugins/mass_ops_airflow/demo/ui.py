"""`mass-ops demo --ui`: the demo's Airflow with its web UI (`airflow standalone`), on 127.0.0.1 only.

Contract: prepares what a run of `mass_cycle` needs (the tiny L0 model, the demo's Airflow home, database and pools),
then runs `airflow standalone` in its own process group until Ctrl-C, which stops the whole group (SIGTERM, then
SIGKILL) and any local model server the UI's runs left behind. Login is one admin user whose password is generated
into a 0600 file in the demo home and never printed; the trigger form's defaults run the same cycle as `mass-ops
demo`; the components get the demo environment, without the variables that point a run at other storage or a
cluster. Details: docs/demo.md (`mass_ops_airflow.demo.ui`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console

from mass_ops.compute import processes
from mass_ops.compute.local import SERVERS_DIR
from mass_ops.config import CycleConfig
from mass_ops_airflow.demo import DEMO_STORAGE_ENV
from mass_ops_airflow.demo.airflow_home import CYCLE_DAG_ID, DEMO_AIRFLOW_HOME, airflow_environment

HOST = "127.0.0.1"
LOOPBACK_SITE = Path(__file__).resolve().with_name("site")
DEFAULT_PORT = 8080
ADMIN_USER = "admin"
PASSWORDS_FILE = "simple_auth_manager_passwords.json"
CYCLE_CONFIG_FILE = "demo-cycle.yaml"
LOG_FILE = "standalone.log"
LOCK_FILE = "ui.lock"
SIMPLE_AUTH_MANAGER = "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
# Where the local backend records the model servers it starts (relative to the working directory, like the stages).
MODEL_SERVERS_DIR = SERVERS_DIR
# Variables that would send the demo's runs to other storage or to a cluster (config.apply_environment,
# compute.kubernetes.settings_dir): the demo is the embedded default, whatever the shell says.
FOREIGN_VARIABLES = ("MASS_METADATA_URL", "MASS_ARTIFACT_URL", "MASS_SETTINGS_DIR")
READY_TIMEOUT_S = 600.0  # a cold start on a 2-core laptop: migrations, four components, the first DAG parse
# Ctrl-C to a prompt in under 10 s: the components stop in 1-5 s after SIGTERM; what is still running after the
# grace is killed, and said so.
STOP_GRACE_S = 6.0
KILL_WAIT_S = 2.0
POLL_S = 2.0


class DemoUiError(RuntimeError):
    """The UI cannot start or stopped by itself (port taken, Airflow exited, DAG import error); one line."""


@dataclass(frozen=True)
class DemoUi:
    """Where the demo's UI lives: its Airflow home, port and login user."""

    home: Path = DEMO_AIRFLOW_HOME
    port: int = DEFAULT_PORT
    user: str = ADMIN_USER

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def passwords_file(self) -> Path:
        return self.home.resolve() / PASSWORDS_FILE

    @property
    def cycle_config_file(self) -> Path:
        return self.home.resolve() / CYCLE_CONFIG_FILE

    @property
    def log_file(self) -> Path:
        return self.home.resolve() / LOG_FILE


def ui_environment(ui: DemoUi, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of `airflow standalone`: `base` plus the demo's Airflow home, API address, login and form."""
    env = {k: v for k, v in base.items() if k not in FOREIGN_VARIABLES}
    env.update(airflow_environment(ui.home))
    # The UI's cycle config file (its deployment preset) names the stores, `--set` included: no variable overrides it.
    for name in DEMO_STORAGE_ENV:
        env.pop(name, None)
    # Airflow's log servers listen on every interface and have no address setting: an interpreter hook (site/)
    # binds them to 127.0.0.1 in every process standalone starts. Last on the path, so that a caller's own
    # sitecustomize (a test's stand-in) comes first; such a hook must install the loopback hook itself.
    paths = [*filter(None, env.get("PYTHONPATH", "").split(os.pathsep)), str(LOOPBACK_SITE)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # standalone starts its components as `airflow <component>` from PATH: the venv's script must come first.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), base.get("PATH") or os.defpath])
    env.update(
        {
            "AIRFLOW__API__HOST": HOST,
            "AIRFLOW__API__PORT": str(ui.port),
            "AIRFLOW__API__BASE_URL": ui.url,
            # Task processes report to the execution API; its default URL assumes port 8080.
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{ui.url}/execution/",
            "AIRFLOW__CORE__AUTH_MANAGER": SIMPLE_AUTH_MANAGER,
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ui.user}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(ui.passwords_file),
            "MASS_DEFAULT_PRESET": str(ui.cycle_config_file),
        }
    )
    return env


def standalone_argv() -> list[str]:
    """`airflow standalone` with the `airflow` script of this interpreter's environment."""
    script = Path(sys.executable).with_name("airflow")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "airflow"]
    return [*head, "standalone"]


def check_port_free(port: int, host: str = HOST) -> None:
    """Refuse a port something already listens on (another UI, another server) before anything starts."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise DemoUiError(f"--port {port}: {host}:{port} is not free ({exc.strerror}); pick another port") from None


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, readable by the owner only. The staging file gets an unpredictable name and
    is created exclusively with mode 0600 (`mkstemp`), so nothing planted under a guessable name is written through
    and the secret is never readable by others, not even for a moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def read_passwords(ui: DemoUi) -> dict[str, str]:
    """The simple auth manager's passwords file ({} when absent); a broken file is a `DemoUiError`."""
    try:
        data = json.loads(ui.passwords_file.read_text(encoding="utf-8") or "{}")
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise DemoUiError(f"{ui.passwords_file}: not a JSON object of user passwords ({exc}); remove it") from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise DemoUiError(f"{ui.passwords_file}: not a JSON object of user passwords; remove it")
    return data


def ensure_password(ui: DemoUi) -> str:
    """The login user's password: kept when the passwords file has one, else generated into it (mode 0600)."""
    passwords = read_passwords(ui)
    if ui.user not in passwords:
        passwords[ui.user] = secrets.token_urlsafe(18)
        _write_private(ui.passwords_file, json.dumps(passwords) + "\n")
    return passwords[ui.user]


def write_cycle_config(ui: DemoUi, config_data: Mapping[str, Any]) -> Path:
    """Write the demo's validated config where the trigger form's default preset points."""
    text = "# The demo cycle (mass-ops demo --ui): the trigger form's default preset. Rewritten at every start.\n"
    _write_private(ui.cycle_config_file, text + yaml.safe_dump(dict(config_data), sort_keys=False))
    return ui.cycle_config_file


class AirflowApi:
    """A logged-in client of the demo Airflow's REST API (bearer token from the simple auth manager)."""

    def __init__(self, url: str, user: str, password: str, *, timeout_s: float = 10.0) -> None:
        self._client = httpx.Client(base_url=url, timeout=timeout_s)
        self._login = {"username": user, "password": password}
        self._token: str | None = None

    def __enter__(self) -> AirflowApi:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._client.close()

    def token(self) -> str:
        """A fresh access token (`POST /auth/token`); a refused login is a `DemoUiError`."""
        response = self._client.post("/auth/token", json=self._login)
        if response.status_code in (400, 401, 403):
            raise DemoUiError(f"Airflow refused the login of {self._login['username']!r} (HTTP {response.status_code})")
        response.raise_for_status()
        return str(response.json()["access_token"])

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One API call with the bearer token (fetched on first use, renewed once when it has expired)."""
        for attempt in (1, 2):
            if self._token is None:
                self._token = self.token()
            response = self._client.request(method, path, headers={"Authorization": f"Bearer {self._token}"}, **kwargs)
            if response.status_code != 401 or attempt == 2:
                return response
            self._token = None
        raise AssertionError("unreachable")

    def get(self, path: str, **params: Any) -> Any:
        """`GET path` → its JSON (HTTP errors raise)."""
        response = self.request("GET", path, params=params)
        response.raise_for_status()
        return response.json()

    def healthy(self) -> bool:
        """Whether the API server answers its health endpoint (no login needed)."""
        try:
            return self._client.get("/api/v2/monitor/health").status_code == 200
        except httpx.TransportError:
            return False

    def dag_problem(self, dag_id: str = CYCLE_DAG_ID) -> str | None:
        """None when `dag_id` is parsed and listed; else what is missing. An import error of it raises."""
        if not self.healthy():
            return "the API server does not answer yet"
        response = self.request("GET", f"/api/v2/dags/{dag_id}")
        if response.status_code == 200:
            return None
        errors = self.get("/api/v2/importErrors").get("import_errors", [])
        for error in errors:
            if Path(str(error.get("filename", ""))).stem == dag_id:
                lines = str(error.get("stack_trace", "")).strip().splitlines() or ["no detail"]
                raise DemoUiError(f"the DAG file of {dag_id} does not import: {lines[-1]}")
        return f"{dag_id} is not parsed yet (HTTP {response.status_code})"


def start_standalone(
    argv: Sequence[str], env: Mapping[str, str], log_file: Path, *, pass_fds: Sequence[int] = ()
) -> subprocess.Popen[bytes]:
    """Start `argv` in its own session and process group, its output appended to `log_file` (`pass_fds`: open
    descriptors it inherits, such as the home's lock)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        try:
            # Own process group: the stop signals reach the standalone parent and every component it started,
            # and a Ctrl-C in this terminal reaches only this process, which stops the group in order.
            return processes.start_in_session(argv, stdout=out, env=env, pass_fds=pass_fds)
        except OSError as exc:
            raise DemoUiError(f"cannot start {argv[0]}: {exc.strerror}") from None


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return "".join(deque(handle, maxlen=lines)).rstrip()
    except FileNotFoundError:
        return ""


group_members = processes.group_members  # live members of a process group (the one supervisor's)


@dataclass(frozen=True)
class GroupStop:
    """How a process group was stopped: the signals sent to it, in order, and the processes that were still running
    when SIGKILL was needed (``"airflow triggerer (pid 123)"``)."""

    signals: list[str]
    killed: list[str]


def describe_process(pid: int) -> str:
    """``"<command line, shortened> (pid N)"`` from /proc, for the line that names what had to be killed."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return f"pid {pid}"
    words = [w.decode(errors="replace").strip() for w in argv if w.strip()]
    # `.../bin/python .../bin/airflow scheduler` reads better as `airflow scheduler`.
    if len(words) > 1 and Path(words[0]).name.startswith("python") and Path(words[1]).name == "airflow":
        words = ["airflow", *words[2:]]
    text = " ".join(words) or "?"
    return f"{text[:60]} (pid {pid})"


def _group_gone(process: subprocess.Popen[bytes], pgid: int) -> bool:
    # poll() reaps the leader, so that it does not linger as a zombie of ours
    return process.poll() is not None and not group_members(pgid)


def stop_group(process: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> GroupStop:
    """Stop `process` and its whole process group within about `grace_s` + `KILL_WAIT_S`: SIGTERM to every member at
    once; a second SIGTERM to what still runs after half the grace; SIGKILL to what still runs after the grace (named
    in the result, so that the caller says so).

    SIGTERM, not SIGINT: LocalExecutor's workers ignore SIGINT, and a task's supervisor turns SIGTERM into the
    task's `on_kill`. All members at once, so that no component waits on another to stop its children in turn. The
    second signal is Airflow's own "signal again if you don't want to wait": the triggerer, whose runner the first
    signal already stopped, otherwise sleeps out its 10 s escalation delay before it notices.
    """
    pgid = process.pid  # the session leader's pid is its group id
    stopped = processes.stop_group(
        pgid,
        grace_s=grace_s,
        kill_wait_s=KILL_WAIT_S,
        term_signals=2,
        running=lambda: not _group_gone(process, pgid),
        describe=describe_process,
    )
    return GroupStop(signals=stopped.signals, killed=stopped.described)


def stop_model_servers(since: float, servers_dir: Path = MODEL_SERVERS_DIR) -> list[str]:
    """Stop the local model servers recorded under `servers_dir` that were started at or after `since` (by runs of
    this UI session and interrupted before their teardown task); returns their state files."""
    from mass_ops.compute.local import LocalServerError, read_state, stop_server

    stopped = []
    for state_file in sorted(servers_dir.rglob("*.json")) if servers_dir.is_dir() else []:
        try:
            state = read_state(state_file)
        except LocalServerError:
            continue  # not ours to judge: a broken file is reported by the stage that uses it
        if state is not None and state.started_at >= since and stop_server(state_file):
            stopped.append(str(state_file))
    return stopped


def wait_until_ready(
    process: subprocess.Popen[bytes], api: AirflowApi, log_file: Path, timeout_s: float = READY_TIMEOUT_S
) -> None:
    """Block until the API server answers and `mass_cycle` is parsed; raise when standalone exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    problem = "not probed yet"
    while True:
        code = process.poll()
        if code is not None:
            raise DemoUiError(
                f"airflow standalone exited with status {code} before the UI was up; last lines of {log_file}:\n"
                f"{_log_tail(log_file)}"
            )
        try:
            problem = api.dag_problem() or ""
        except httpx.HTTPError as exc:
            problem = f"the API answered {type(exc).__name__}: {exc}"
        if not problem:
            return
        if time.monotonic() >= deadline:
            raise DemoUiError(f"the UI was not ready within {timeout_s:.0f} s ({problem}); see {log_file}")
        time.sleep(POLL_S)


@contextlib.contextmanager
def _stop_signals(handler: Any) -> Iterator[None]:
    """Handle SIGINT, SIGTERM and SIGHUP with `handler` for the block, then restore what was there."""
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _interrupt(signum: int, frame: object) -> None:
    # SIGTERM (a service manager's stop) and SIGHUP (the terminal closed) are clean stops too, exactly like Ctrl-C:
    # standalone runs in its own session, so nothing else would stop it.
    raise KeyboardInterrupt


def lock_home(ui: DemoUi) -> int:
    """Take the home's UI lock and return its descriptor; a second UI on the same home is refused.

    `serve` passes the descriptor to `airflow standalone`, so the lock lasts as long as standalone does, even if
    this process is killed without a chance to stop it.
    """
    ui.home.mkdir(parents=True, exist_ok=True)
    path = ui.home.resolve() / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DemoUiError(f"another demo UI runs on {ui.home} (it holds {path}); stop it first") from None
    return fd


def validate(ui: DemoUi, overrides: list[str] | None) -> CycleConfig:
    """The checks that need nothing written: the port is free and the demo config with `overrides` is valid."""
    from mass_ops_airflow.demo import demo_config

    check_port_free(ui.port)
    return demo_config(overrides)


def prepare(ui: DemoUi, config: CycleConfig, console: Console) -> dict[str, str]:
    """Everything the UI's runs need, in order; returns the environment of `airflow standalone`."""
    from mass_ops_airflow.demo import prepare_parent
    from mass_ops_airflow.demo.airflow_home import prepare_database, use_demo_airflow

    console.print(f"building and publishing the tiny L0 model ({config.models.served_name})", markup=False)
    prepare_parent(config)
    write_cycle_config(ui, config.model_dump(mode="json"))
    console.print(f"preparing the Airflow home {ui.home} (database, pools)", markup=False)
    use_demo_airflow(ui.home)
    prepare_database()
    ensure_password(ui)
    return ui_environment(ui, os.environ)


def serve(
    ui: DemoUi,
    env: Mapping[str, str],
    console: Console,
    *,
    argv: Sequence[str] | None = None,
    lock_fd: int | None = None,
) -> int:
    """Run standalone until Ctrl-C, SIGTERM or SIGHUP (0) or until it exits by itself (1); everything it started
    is stopped either way. `lock_fd` (from `lock_home`) is handed down to standalone."""
    started = time.time()
    with _stop_signals(_interrupt):
        fds = () if lock_fd is None else (lock_fd,)
        process = start_standalone(argv or standalone_argv(), env, ui.log_file, pass_fds=fds)
        try:
            console.print(f"starting airflow standalone (log: {ui.log_file})", markup=False)
            with AirflowApi(ui.url, ui.user, ensure_password(ui)) as api:
                wait_until_ready(process, api, ui.log_file)
            _print_banner(ui, console)
            code = process.wait()
            console.print(f"airflow standalone exited with status {code}; last lines of {ui.log_file}:", markup=False)
            console.print(_log_tail(ui.log_file), markup=False, highlight=False)
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            # A second Ctrl-C must not leave Airflow half stopped: the stop is bounded, so it runs to the end.
            with _stop_signals(signal.SIG_IGN):
                console.print(f"stopping Airflow (up to {STOP_GRACE_S + KILL_WAIT_S:.0f} s) …", markup=False)
                stopped = stop_group(process)
                if stopped.killed:
                    console.print(
                        f"killed (SIGKILL) what was still running {STOP_GRACE_S:.0f} s after SIGTERM: "
                        + ", ".join(stopped.killed),
                        markup=False,
                        highlight=False,
                        soft_wrap=True,
                    )
                for state_file in stop_model_servers(started):
                    console.print(f"stopped the model server recorded in {state_file}", markup=False)
            console.print("stopped", markup=False)


def _print_banner(ui: DemoUi, console: Console) -> None:
    console.rule("[bold]mass-ops demo UI")
    lines = [
        f"open {ui.url} (Airflow {_airflow_version()}, home {ui.home})",
        f"log in as {ui.user!r}; the password is in {ui.passwords_file} (JSON: user -> password)",
        f"trigger {CYCLE_DAG_ID}: its form's default preset {ui.cycle_config_file} is the demo cycle;",
        "  keep 'Unpause on trigger' ticked (DAGs start paused), change knobs, then Trigger",
        f"runs write under runs/demo/; logs of Airflow: {ui.log_file}",
        "Ctrl-C stops Airflow and any model server its runs left running",
    ]
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _airflow_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("apache-airflow")
    except PackageNotFoundError:
        return "?"


def run_ui(overrides: list[str] | None, *, port: int, console: Console, err_console: Console) -> int:
    """`mass-ops demo --ui`: validate, prepare, serve until Ctrl-C; returns the exit status (2: bad input or a UI
    already running, 1: failure)."""
    from mass_ops.config import ConfigError
    from mass_ops_airflow.demo.airflow_home import DemoAirflowError

    def problem(text: str) -> None:
        err_console.print(f"demo --ui: {text}", markup=False, highlight=False, soft_wrap=True)

    ui = DemoUi(port=port)
    try:
        config = validate(ui, overrides)
        lock_fd = lock_home(ui)
    except ConfigError as exc:
        for line in exc.problems:
            err_console.print(line, markup=False, highlight=False, soft_wrap=True)
        return 2
    except DemoUiError as exc:
        problem(str(exc))
        return 2
    try:
        return serve(ui, prepare(ui, config, console), console, lock_fd=lock_fd)
    except DemoAirflowError as exc:
        problem(str(exc))
        return 2
    except DemoUiError as exc:
        problem(str(exc))
        return 1
    finally:
        os.close(lock_fd)
