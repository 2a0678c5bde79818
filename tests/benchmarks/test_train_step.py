"""`benchmarks/train_step.py` at its --tiny size, so it cannot rot: both figures and the ratio print and parse, and
packing computes less padding than padding each window (no timing is asserted)."""

from __future__ import annotations

import math
import re

from benchmarks.train_step import main, window_lengths


def test_the_tiny_benchmark_prints_both_figures_and_a_finite_ratio(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--tiny"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "padded",
        "packed",
        "ratio packed/padded",
        "unpadded (one window per micro-batch, shapes vary)",
    ]
    padded, packed = (float(re.search(r": (\d+) tokens/s", line).group(1)) for line in lines[:2])  # type: ignore[union-attr]
    ratio = float(lines[2].split(": ")[1])
    assert padded > 0 and packed > 0 and math.isfinite(ratio) and ratio > 0
    pads = [int(re.search(r"(\d+) padding tokens", line).group(1)) for line in lines[:2]]  # type: ignore[union-attr]
    assert pads[1] < pads[0]


def test_window_lengths_are_seeded_and_within_the_budget() -> None:
    lengths = window_lengths(50, 1024)
    assert lengths == window_lengths(50, 1024) and all(64 <= n <= 1024 for n in lengths)
