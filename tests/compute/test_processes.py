"""Process-group supervision: a command starts as its own group's leader, and stopping the group ends every member
(SIGKILL for what ignores SIGTERM), reaps the leader, and is idempotent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mass_ops.compute.processes import (
    group_alive,
    group_members,
    start_in_session,
    stop_child,
    stop_group,
)
from tests.compute.test_local import running

# A leader that ignores SIGTERM and starts a grandchild in its group, printing the grandchild's pid.
STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_command_leads_its_own_group_and_stop_group_kills_every_member():
    process = start_in_session([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    grandchild = int(process.stdout.readline())
    try:
        assert os.getpgid(process.pid) == process.pid != os.getpgid(0)
        assert {process.pid, grandchild} <= set(group_members(process.pid))
        stopped = stop_group(process.pid, grace_s=0.5, kill_wait_s=5, describe=lambda pid: f"member {pid}")
        assert stopped.signals == ["SIGTERM", "SIGKILL"]
        assert process.pid in stopped.killed
        assert f"member {process.pid}" in stopped.described  # named before the SIGKILL took it
        assert process.poll() is not None  # reaped while waiting: no zombie left
        assert wait_until(lambda: not running(grandchild))
        assert not group_alive(process.pid)
        assert stop_group(process.pid, grace_s=0.5).signals == []  # already gone: nothing sent
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_stop_group_spreads_its_sigterms_over_the_grace():
    process = start_in_session([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.DEVNULL)
    stopped = stop_group(process.pid, grace_s=4, term_signals=2)
    assert stopped.signals == ["SIGTERM"] and stopped.killed == []
    # Not the exit status: the stop reaps the leader while it waits, and Popen then reads 0 for a reaped child.
    process.wait(timeout=5)
    assert not group_alive(process.pid)


def test_stop_child_signals_the_group_and_reaps_the_child():
    process = start_in_session([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    grandchild = int(process.stdout.readline())
    stopped = stop_child(process, grace_s=0.5)
    assert stopped.signals == ["SIGTERM", "SIGKILL"] and process.returncode == -signal.SIGKILL
    assert wait_until(lambda: not running(grandchild))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_die_with_parent_stops_the_command_when_its_starter_is_killed():
    starter = (
        "import subprocess, sys, time\n"
        "from mass_ops.compute.processes import start_in_session\n"
        "child = start_in_session([sys.executable, '-c', 'import time; time.sleep(60)'], stdout=subprocess.DEVNULL,"
        " die_with_parent=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    child = int(process.stdout.readline())
    assert running(child)
    process.kill()  # no chance to clean up: only the kernel's parent-death signal reaches the child
    process.wait()
    assert wait_until(lambda: not running(child))
