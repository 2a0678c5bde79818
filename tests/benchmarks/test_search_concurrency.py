"""`benchmarks/search_concurrency.py` at a tiny size, so it cannot rot: both orders do the same work and the figure
lines parse (the speedup target is the benchmark's verdict, not the suite's)."""

from __future__ import annotations

import tempfile

import pytest

from benchmarks.search_concurrency import main
from tests.support.benchmarks import figure


def test_one_task_searched_and_collected_in_both_orders(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)  # the script points it at its own scratch folder
    argv = ["--tasks", "1", "--iterations", "1", "--candidates", "2", "--latency", "0.001", "--episode-turns", "1"]
    main([*argv, "--capacity", "2"])
    out = capsys.readouterr().out
    assert figure(out, "mass-ops:") > 0  # seconds
    assert figure(out, "sequential:") > 0
    assert figure(out, "2 teacher episodes") >= 0  # CPU seconds (the same work in both runs, or the script stops)
    assert figure(out, "speedup of mass-ops over the reference order:") > 0
    assert figure(out, "mass-ops wall / bound =") > 0
