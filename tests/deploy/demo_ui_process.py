"""`mass-ops demo --ui` as a test runs it: the real command in a subprocess, isolated in a temporary folder.

The command is started with the temporary folder as its working directory, so everything the demo keeps under
`runs/demo/` (Airflow home, metadata database, artifacts, the tiny model) and the model servers' state under
`runs/servers/` land there, never in the repository's `runs/`. With `stand_in_policy` the scripted policy stand-in
replaces `transformers serve` in every Python process of the UI (see `stand_in_serving`).

Cleanup never depends on the command behaving: the command runs in its own process group, and every process whose
environment names this UI's Airflow home (standalone, its components, task processes, model servers) is found
through /proc and killed by pid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mass_ops_airflow.demo.airflow_home import DEMO_AIRFLOW_HOME
from mass_ops_airflow.demo.ui import AirflowApi, DemoUi, read_passwords

REPO_ROOT = Path(__file__).resolve().parents[2]
STAND_IN_SITE = Path(__file__).with_name("stand_in_site")
CHROMIUM = Path("/usr/bin/chromium")
STOP_TIMEOUT_S = 120.0


def free_port(count: int = 1) -> int:
    """A port P on 127.0.0.1 with P .. P+count-1 all free right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        if all(_is_free(base + i) for i in range(1, count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found")


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def processes_with_env(name: str, value: str) -> list[int]:
    """Pids of live processes whose environment has `name=value` (other users' processes are not readable)."""
    wanted = f"{name}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X") and wanted in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def chromium_executable() -> str:
    """The system Chromium (Playwright drives it; nothing is downloaded). Missing: `apt-get install -y chromium`;
    skipped, loudly, only where apt cannot be used."""
    if CHROMIUM.exists():
        return str(CHROMIUM)
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip(
            f"BROWSER TEST NOT RUN: {CHROMIUM} is missing and apt-get is unavailable (or not root) to install "
            "chromium; install it to run the Airflow UI test"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    result = subprocess.run(
        ["apt-get", "install", "-y", "chromium"], env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    if result.returncode != 0 or not CHROMIUM.exists():
        pytest.fail(f"apt-get install -y chromium failed (exit {result.returncode}): {result.stderr[-2000:]}")
    return str(CHROMIUM)


@dataclass
class DemoUiProcess:
    """One `mass-ops demo --ui --port PORT [ARGS]` run in `workdir`; a context manager that always cleans up."""

    workdir: Path
    port: int
    args: Sequence[str] = ()
    stand_in_policy: bool = True
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def ui(self) -> DemoUi:
        return DemoUi(home=self.workdir / DEMO_AIRFLOW_HOME, port=self.port)

    @property
    def log_file(self) -> Path:
        return self.workdir / "demo-ui.log"

    def environment(self) -> dict[str, str]:
        """This environment without Airflow's variables (a test session may point Airflow elsewhere), with the
        repository (and the stand-in hook) on PYTHONPATH."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        paths = [str(STAND_IN_SITE)] if self.stand_in_policy else []
        paths += [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["MASS_DAGS_DIR"] = str(REPO_ROOT / "dags")  # it runs in a temporary folder, not a clone
        return env

    def start(self) -> None:
        argv = [sys.executable, "-m", "mass_ops.cli", "demo", "--ui", "--port", str(self.port), *self.args]
        with open(self.log_file, "ab") as out:
            self.process = subprocess.Popen(
                argv,
                cwd=self.workdir,
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_file.read_text(errors="replace") if self.log_file.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def password(self) -> str:
        return read_passwords(self.ui)[self.ui.user]

    def api(self) -> AirflowApi:
        return AirflowApi(self.ui.url, self.ui.user, self.password(), timeout_s=30.0)

    def wait_ready(self, timeout_s: float) -> None:
        """Until the UI answers and lists mass_cycle (what the command waits for before its banner)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        problem = "not started"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"mass-ops demo --ui exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.ui.passwords_file.exists():
                with self.api() as api:
                    problem = api.dag_problem() or ""
                if not problem:
                    return
            time.sleep(2)
        pytest.fail(f"the demo UI was not ready within {timeout_s} s ({problem}):\n{self.log_tail()}")

    def leftovers(self) -> list[int]:
        """Processes still running with this UI's Airflow home in their environment."""
        return processes_with_env("AIRFLOW_HOME", str(self.ui.home.resolve()))

    def interrupt(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Ctrl-C to the command (SIGINT), then wait for it to exit; returns its exit status (None: still running)."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout_s)
        return self.process.poll()

    def kill_everything(self) -> None:
        """Last resort, whatever happened: the command's process group, then every leftover, by pid."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> DemoUiProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.interrupt()
        finally:
            self.kill_everything()
