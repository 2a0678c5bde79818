"""Stopping a real `airflow standalone` the way `mass-ops demo --ui` does on Ctrl-C (slow: a cold start of Airflow's
four components on a private home).

The fake process trees of test_demo_ui.py check the escalation itself; this checks it against Airflow's own
components: every one of them is gone when `stop_group` returns, and the first signal they got was SIGTERM.
No timing is asserted; the stop's duration is printed for the record.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from mass_ops_airflow.demo import ui as demo_ui
from mass_ops_airflow.demo.ui import AirflowApi, DemoUi

from tests.deploy.demo_ui_process import free_port

READY_TIMEOUT_S = 600.0
READY_LINE = "Airflow is ready"  # standalone prints it once scheduler, DAG processor and triggerer heartbeat
COMPONENTS = ("airflow scheduler", "airflow dag-processor", "airflow triggerer", "airflow api_server")


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting for its reaper has stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_until_up(process, ui: DemoUi, password: str) -> None:
    """Until standalone says its jobs heartbeat and the API server answers a logged-in call; fails at once, with
    standalone's own last lines, when it exits."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with AirflowApi(ui.url, ui.user, password, timeout_s=30.0) as api:
        while True:
            if process.poll() is not None:
                pytest.fail(f"airflow standalone exited with {process.returncode}:\n{demo_ui._log_tail(ui.log_file)}")
            log = ui.log_file.read_text(errors="replace") if ui.log_file.exists() else ""
            if READY_LINE in log and api.healthy() and api.get("/api/v2/version"):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"standalone not up within {READY_TIMEOUT_S:.0f} s:\n{demo_ui._log_tail(ui.log_file)}")
            time.sleep(1)


@pytest.mark.slow
@pytest.mark.timeout(READY_TIMEOUT_S + 120)
def test_ctrl_c_stop_of_a_real_standalone_sends_sigterm_first_and_leaves_nothing(tmp_path: Path) -> None:
    ui = DemoUi(home=tmp_path / "airflow", port=free_port())
    password = demo_ui.ensure_password(ui)
    base = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    process = demo_ui.start_standalone(demo_ui.standalone_argv(), demo_ui.ui_environment(ui, base), ui.log_file)
    try:
        _wait_until_up(process, ui, password)
        members = demo_ui.group_members(process.pid)
        running = " ".join(demo_ui.describe_process(pid) for pid in members)
        assert all(name in running for name in COMPONENTS), running

        started = time.monotonic()
        stopped = demo_ui.stop_group(process)
        seconds = time.monotonic() - started
        print(f"standalone stopped in {seconds:.1f} s with {stopped.signals}; killed: {stopped.killed}")

        assert demo_ui.group_members(process.pid) == []
        assert not [pid for pid in members if _running(pid)], "a component outlived the stop"
        # The leader ignores neither signal: it died of the first one, which reached the whole group at once.
        assert process.returncode == -signal.SIGTERM
        assert stopped.signals[0] == "SIGTERM"
        # A SIGKILL is never silent: the result names what was still running.
        assert ("SIGKILL" in stopped.signals) == bool(stopped.killed)
    finally:
        if process.poll() is None or demo_ui.group_members(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
