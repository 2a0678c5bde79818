"""A killed train stage leaves no training job behind (found by the fault matrix: the job ran on and its log made
the rerun's trainer refuse to start)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mass_ops.stages.train import TRAINER_PGID_FILE, _stop_leftover_trainer

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


def gone(pid: int) -> bool:
    """No such process, or one that has exited and waits to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_training_launcher_dies_with_a_killed_stage(tmp_path: Path):
    stage = textwrap.dedent(
        f"""
        import subprocess, sys, time
        from mass_ops.stages.train import _parent_death_signal
        child = subprocess.Popen({SLEEPER!r}, start_new_session=True, preexec_fn=_parent_death_signal())
        print(child.pid, flush=True)
        time.sleep(300)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", stage], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        launcher = int(process.stdout.readline())
        assert not gone(launcher)
        process.kill()  # SIGKILL: the stage runs no cleanup
        process.wait(timeout=30)
        assert wait_gone(launcher), "the launcher outlived the stage that started it"
    finally:
        process.kill()
        if not gone(launcher):  # only when the test failed: leave nothing running
            os.kill(launcher, signal.SIGKILL)


def test_a_rerun_stops_the_job_a_killed_run_left_in_its_work_folder(tmp_path: Path):
    leftover = subprocess.Popen(SLEEPER, start_new_session=True)
    (tmp_path / TRAINER_PGID_FILE).write_text(f"{leftover.pid}\n")
    _stop_leftover_trainer(tmp_path)
    assert leftover.wait(timeout=30) == -signal.SIGTERM
    assert not (tmp_path / TRAINER_PGID_FILE).exists()
    _stop_leftover_trainer(tmp_path)  # nothing recorded: nothing to do
