"""Reading what a benchmark script prints, in the suite: its figure lines must parse, whatever the numbers say."""

from __future__ import annotations

import math
import re

# A printed figure: digits with an optional sign, thousands commas and decimals (``338,393``, ``-0.18``, ``1.83x``).
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


def figure(text: str, label: str) -> float:
    """The first number after `label` on the line of `text` that holds it; an assertion naming the label when the
    label or its number is missing, or the number is not finite."""
    match = re.search(re.escape(label) + r"[^\d\n]*?(" + _NUMBER + ")", text)
    assert match is not None, f"no figure after {label!r} in the benchmark's output:\n{text}"
    value = float(match.group(1).replace(",", ""))
    assert math.isfinite(value), f"{label!r}: {value} is not a finite figure"
    return value
