"""Learning-rate schedule of the SFT run (MASS_SPEC §8): linear warmup, then cosine from the peak to a floor.

`step` is the 0-based index of the optimizer update (the update that completes step `step + 1`).
"""

from __future__ import annotations

import math


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR for update `step`.

    Warmup: (step + 1) / warmup_steps for step < warmup_steps. Then
    min_lr_ratio + (1 − min_lr_ratio)·½·(1 + cos(π·prog)), prog = (step − warmup) / (total − warmup), so the first
    post-warmup update runs at the peak and the floor is approached at the end of the run.
    """
    if step < 0:
        raise ValueError(f"lr schedule: step must be >= 0 (got {step})")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = total_steps - warmup_steps
    progress = min(1.0, (step - warmup_steps) / span) if span > 0 else 1.0
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(step: int, *, peak: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of update `step`."""
    return peak * lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
