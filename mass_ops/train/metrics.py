"""Steady-state throughput of a training run: warm-up steps named and left out, step-time percentiles, tokens/s,
MFU in two conventions, peak memory, and what the warm-up steps spent their time on.

Every logged step row carries `warmup` (one of the first `warmup_measure_steps` steps of this process) and `phases`:
wall seconds of data preparation, forward, backward and optimizer step, measured with the accelerator synchronised
at each boundary so the time lands where the device spent it. `summarize` turns the rows of a run into one record,
written as `throughput.json` beside the train log; scripts/gpu_check.py prints it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SUMMARY_FILE = "throughput.json"
PHASES = ("data_s", "forward_s", "backward_s", "optimizer_s")


class PhaseClock:
    """Accumulates wall seconds per phase of one step; `sync` waits for the accelerator (a no-op on CPU)."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self._sync = sync
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - started

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.seconds.items()}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def dynamo_recompiles() -> int | None:
    """Graph recompilations torch.compile counted in this process; None when torch.compile never ran."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    if not counters or "stats" not in counters:
        return None
    return int(sum(counters.get("recompiles", {}).values()))


def _rate(numerator: float, seconds: float) -> float | None:
    return round(numerator / seconds, 3) if seconds > 0 else None


def summarize(
    rows: Sequence[Mapping[str, Any]],
    *,
    warmup_steps: int,
    peak_tflops_per_gpu: float | None,
    setup_s: Mapping[str, float] | None = None,
    knobs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One record of a run's step rows (those with `step_s`): the first `warmup_steps` are named and excluded.

    Rates are totals over the measured steps (tokens ÷ seconds), not medians of per-step rates; MFU is the
    measured model TFLOP/s per GPU over the peak, in our convention and in NeMo's LoRA-causal one. With no step
    left after warm-up the figures are None and `measured_steps` is 0.
    """
    steps = [r for r in rows if "step_s" in r]
    warm, measured = steps[:warmup_steps], steps[warmup_steps:]
    seconds = float(sum(r["step_s"] for r in measured))
    out: dict[str, Any] = {
        "warmup_steps_excluded": [r["step"] for r in warm],
        "measured_steps": len(measured),
        "measured_s": round(seconds, 3),
        "warmup": [{"step": r["step"], "step_s": r["step_s"], **(r.get("phases") or {})} for r in warm],
        "setup_s": dict(setup_s or {}),
        "recompiles": dynamo_recompiles(),
        "knobs": dict(knobs or {}),
    }
    if not measured:
        return {**out, "step_s_p50": None, "step_s_p95": None, "tokens_per_s": None, "mfu": None}
    times = [r["step_s"] for r in measured]
    p50, p95 = percentile(times, 50), percentile(times, 95)

    def tflops(key: str) -> float | None:
        if seconds <= 0 or any(r.get(key) is None for r in measured):
            return None
        flops = sum(float(r[key]) * float(r["step_s"]) for r in measured)
        return round(flops / seconds, 6)  # total FLOPs ÷ total time, not a mean of per-step rates

    ours, lora = tflops("model_tflops_per_gpu"), tflops("model_tflops_per_gpu_lora_causal")
    peak = peak_tflops_per_gpu
    phases = {k: round(sum((r.get("phases") or {}).get(k, 0.0) for r in measured) / len(measured), 4) for k in PHASES}
    return {
        **out,
        "step_s_p50": round(p50, 4),
        "step_s_p95": round(p95, 4),
        "step_s_p95_over_p50": round(p95 / p50, 3) if p50 > 0 else None,
        "tokens_per_s": _rate(sum(r["input_tokens"] for r in measured), seconds),
        "supervised_tokens_per_s": _rate(sum(r["tokens"] for r in measured), seconds),
        "model_tflops_per_gpu": ours,
        "mfu": None if ours is None or not peak else round(ours / peak, 5),
        "model_tflops_per_gpu_lora_causal": lora,
        "mfu_lora_causal": None if lora is None or not peak else round(lora / peak, 5),
        "peak_mem_gib": max(r.get("peak_mem_gib", 0.0) for r in steps),
        "peak_reserved_gib": max(r.get("peak_reserved_gib", 0.0) for r in steps),
        "mean_phases_s": phases,
        "pad_tokens_per_step": round(sum(r.get("pad_tokens", 0) for r in measured) / len(measured), 1),
    }


def describe(summary: Mapping[str, Any]) -> str:
    """One log line of a summary."""
    if not summary.get("measured_steps"):
        return f"throughput: no step after the {len(summary['warmup_steps_excluded'])} warm-up steps"

    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1%}"

    return (
        f"throughput after warm-up steps {summary['warmup_steps_excluded']}: {summary['measured_steps']} steps, "
        f"step p50 {summary['step_s_p50']:.3f} s p95 {summary['step_s_p95']:.3f} s, "
        f"{summary['tokens_per_s']:.0f} tokens/s ({summary['supervised_tokens_per_s']:.0f} supervised), "
        f"MFU {pct(summary['mfu'])} (NeMo LoRA-causal {pct(summary['mfu_lora_causal'])}), "
        f"peak memory {summary['peak_mem_gib']:.1f} GiB"
    )


def write_summary(out_dir: str | Path, summary: Mapping[str, Any]) -> Path:
    """Write `throughput.json` atomically."""
    path = Path(out_dir) / SUMMARY_FILE
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path
