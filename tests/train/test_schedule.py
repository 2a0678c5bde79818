"""Linear warmup then cosine to min_lr_ratio (MASS_SPEC §8), checked at the paper's constants."""

from __future__ import annotations

import itertools
import math

import pytest

from mass_ops.train.schedule import lr_at, lr_factor

PAPER = {"peak": 3e-5, "warmup_steps": 5, "total_steps": 1624, "min_lr_ratio": 0.1}


def test_warmup_is_linear_from_a_fifth_of_the_peak() -> None:
    assert [lr_at(s, **PAPER) for s in range(5)] == pytest.approx([6e-6, 1.2e-5, 1.8e-5, 2.4e-5, 3e-5])


def test_cosine_starts_at_the_peak_and_ends_near_the_floor() -> None:
    assert lr_at(5, **PAPER) == pytest.approx(3e-5)
    # Halfway through the cosine: floor + half the remaining span.
    mid = 5 + (1624 - 5) / 2
    assert lr_factor(int(mid), warmup_steps=5, total_steps=1624, min_lr_ratio=0.1) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 5) / 1619))
    )
    assert lr_factor(int(mid), warmup_steps=5, total_steps=1624, min_lr_ratio=0.1) == pytest.approx(0.55, abs=1e-3)
    last = lr_at(1623, **PAPER)
    assert last == pytest.approx(3e-5 * (0.1 + 0.45 * (1 + math.cos(math.pi * 1618 / 1619))))
    assert 3e-6 < last < 3.0001e-6
    assert lr_at(1624, **PAPER) == pytest.approx(3e-6)  # progress is clamped at the end


def test_schedule_never_rises_after_warmup_and_stays_above_the_floor() -> None:
    values = [lr_at(s, **PAPER) for s in range(5, 1624)]
    assert all(a >= b for a, b in itertools.pairwise(values))
    assert min(values) >= 3e-6


def test_no_warmup_and_degenerate_spans() -> None:
    assert lr_factor(0, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) == pytest.approx(1.0)
    assert lr_factor(10, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) == pytest.approx(0.0)
    assert lr_factor(3, warmup_steps=3, total_steps=3, min_lr_ratio=0.2) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="step must be >= 0"):
        lr_factor(-1, warmup_steps=5, total_steps=10, min_lr_ratio=0.1)
