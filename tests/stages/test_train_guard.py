"""A killed train stage leaves no training job behind (found by the fault matrix: the job ran on and its log made
the rerun's trainer refuse to start)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mass_ops.stages.train import TRAINER_PGID_FILE, _stop_leftover_trainer

# A leftover job: says which signal ended it, once its handler is in place (it writes `ready` then).
LEFTOVER = """
import pathlib, signal, sys, time
folder = pathlib.Path(sys.argv[1])
def stopped(signum, frame):
    (folder / "signal").write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stopped)
(folder / "ready").write_text("")
time.sleep(300)
"""


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


def test_the_training_launcher_is_started_to_die_with_the_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The launcher leads its own group and gets SIGTERM when the stage dies (the supervisor's `die_with_parent`,
    tested in tests/compute/test_processes.py): a stage killed with SIGKILL leaves no training job behind."""
    from types import SimpleNamespace

    from mass_ops.compute import processes
    from mass_ops.stages import train as train_stage

    seen: dict[str, object] = {}
    real = processes.start_in_session

    def spy(argv, **options):
        seen.update(options)
        return real(argv, **options)

    monkeypatch.setattr(processes, "start_in_session", spy)
    code, tail = train_stage._run_training(
        [sys.executable, "-c", "print('trained')"],
        tmp_path,
        dict(os.environ),
        tmp_path / "log",
        SimpleNamespace(poll=lambda: None),
    )
    assert (code, tail) == (0, ["trained"])
    assert seen["die_with_parent"] is True
    assert (tmp_path / "log").read_text() == "trained\n"


def test_a_rerun_stops_the_job_a_killed_run_left_in_its_work_folder(tmp_path: Path):
    """SIGTERM first. The job's exit status cannot tell: the stop reaps the group's leader while it waits (a real
    leftover is not its child), so the test reads which signal the job saw instead."""
    signals = tmp_path / "signals"
    signals.mkdir()
    leftover = subprocess.Popen([sys.executable, "-c", LEFTOVER, str(signals)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (signals / "ready").exists():
        assert leftover.poll() is None and time.monotonic() < deadline, "the leftover job did not start"
        time.sleep(0.05)
    (tmp_path / TRAINER_PGID_FILE).write_text(f"{leftover.pid}\n")
    _stop_leftover_trainer(tmp_path)
    assert wait_gone(leftover.pid)
    assert (signals / "signal").read_text() == signal.SIGTERM.name
    leftover.wait(timeout=5)  # reaped here unless the stop already did
    assert not (tmp_path / TRAINER_PGID_FILE).exists()
    _stop_leftover_trainer(tmp_path)  # nothing recorded: nothing to do
