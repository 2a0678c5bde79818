"""Steady-state figures of a run: warm-up steps named and left out, percentiles, rates as totals over time, MFU in
both conventions."""

from __future__ import annotations

import pytest

from mass_ops.train.metrics import PhaseClock, describe, percentile, summarize


def _row(step: int, step_s: float) -> dict:
    return {
        "step": step,
        "step_s": step_s,
        "input_tokens": 8192,
        "tokens": 4096,
        "model_tflops_per_gpu": 400.0 / step_s,  # the same FLOPs every step
        "model_tflops_per_gpu_lora_causal": 300.0 / step_s,
        "peak_mem_gib": 50.0 + step,
        "peak_reserved_gib": 60.0,
        "phases": {"data_s": 0.0, "forward_s": step_s / 3, "backward_s": step_s / 2, "optimizer_s": step_s / 6},
        "pad_tokens": 0,
    }


def test_percentiles_interpolate_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_warmup_steps_are_named_explained_and_excluded() -> None:
    rows = [_row(1, 14.0), _row(2, 2.0)] + [_row(s, 1.0) for s in range(3, 9)] + [_row(9, 2.0)]
    summary = summarize(rows, warmup_steps=2, peak_tflops_per_gpu=1000.0, setup_s={"model": 20.0})
    assert summary["warmup_steps_excluded"] == [1, 2] and summary["measured_steps"] == 7
    assert summary["warmup"][0] == {
        "step": 1,
        "step_s": 14.0,
        "data_s": 0.0,
        "forward_s": 14.0 / 3,
        "backward_s": 7.0,
        "optimizer_s": 14.0 / 6,
    }
    assert summary["step_s_p50"] == 1.0 and summary["step_s_p95"] == pytest.approx(1.7)
    assert summary["tokens_per_s"] == pytest.approx(7 * 8192 / 8.0) and summary["supervised_tokens_per_s"] == 3584.0
    # Total FLOPs over total time: 7 × 400 TFLOP in 8 s = 350 TFLOP/s, not the mean of per-step rates.
    assert summary["model_tflops_per_gpu"] == pytest.approx(350.0) and summary["mfu"] == pytest.approx(0.35)
    assert summary["mfu_lora_causal"] == pytest.approx(0.2625)
    assert summary["peak_mem_gib"] == 59.0 and summary["setup_s"] == {"model": 20.0}
    assert "warm-up steps [1, 2]" in describe(summary) and "26.2%" in describe(summary)


def test_without_a_peak_or_a_measured_step() -> None:
    assert summarize([_row(1, 1.0), _row(2, 1.0)], warmup_steps=1, peak_tflops_per_gpu=None)["mfu"] is None
    empty = summarize([_row(1, 3.0)], warmup_steps=2, peak_tflops_per_gpu=989.0)
    assert empty["measured_steps"] == 0 and empty["tokens_per_s"] is None
    assert describe(empty) == "throughput: no step after the 1 warm-up steps"


def test_the_phase_clock_synchronises_at_every_boundary() -> None:
    syncs = []
    clock = PhaseClock(lambda: syncs.append(1))
    for name in ("data_s", "forward_s", "forward_s"):
        with clock.phase(name):
            pass
    assert len(syncs) == 3 and set(clock.rounded()) == {"data_s", "forward_s", "backward_s", "optimizer_s"}
