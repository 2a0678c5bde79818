"""`benchmarks/sandbox_start.py` with one run per mode, so it cannot rot: an attempt succeeds with and without bwrap
and the figure lines parse (no timing asserted)."""

from __future__ import annotations

import pytest

from benchmarks.sandbox_start import main
from mass_ops.compute.sandbox import bwrap_support
from tests.support.benchmarks import figure


def test_one_attempt_per_mode_and_the_ratio_prints(capsys: pytest.CaptureFixture[str]) -> None:
    support = bwrap_support()
    if not support.available:
        pytest.skip(f"no bwrap sandbox on this machine: {support.reason}")
    main(["--runs", "1", "--requests", "1"])
    out = capsys.readouterr().out
    assert figure(out, "unsandboxed    median agent") > 0  # ms
    assert figure(out, "bwrap sandbox  median agent") > 0
    assert figure(out, "to the agent (ratio") > 0
    assert figure(out, "to the whole attempt (ratio") > 0
