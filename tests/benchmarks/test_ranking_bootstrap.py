"""`benchmarks/ranking_bootstrap.py` at a tiny size, so it cannot rot: its figure line parses (no timing asserted)."""

from __future__ import annotations

import pytest

from benchmarks.ranking_bootstrap import main
from tests.support.benchmarks import figure


def test_the_benchmark_prints_both_fits_and_their_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--candidates", "4", "--opponents", "2", "--resamples", "20"])
    out = capsys.readouterr().out
    assert figure(out, "20 resamples:") >= 0  # seconds, fitted at once
    assert figure(out, "fitted at once,") >= 0  # seconds, one by one
    assert figure(out, "ratio") > 0
