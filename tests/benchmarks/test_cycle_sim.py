"""`benchmarks/cycle_sim.py` at a tiny size, so it cannot rot: every schedule runs one task through the stage code
and the figure lines parse (the utilisation goal is the benchmark's verdict, not the suite's)."""

from __future__ import annotations

import tempfile

import pytest

from benchmarks.cycle_sim import main
from tests.support.benchmarks import figure

TINY = ["--tasks", "1", "--iterations", "1", "--candidates", "3", "--opponents", "2", "--capacity", "2"]


def test_one_task_runs_under_every_schedule(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)  # the script points it at its own scratch folder
    main([*TINY, "--median", "0.02", "--judge", "0.002", "--optimizer", "0.002"])
    out = capsys.readouterr().out
    for schedule in ("reference", "today", "pipelined"):
        assert figure(out, f"{schedule}: wall") > 0, schedule  # seconds
    assert "6 episodes" in out, out  # reference, v0, v1 and three candidates
    assert figure(out, "pipelined / reference:") > 0
    assert figure(out, "pipelined wall over it") > 0
