"""Readers of a cycle's training runs: the runs themselves, their loss curves (the training log in the artifact
store, completed by the checkpoint rows) and the throughput fields the trainer logs per step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mass_ops.compute.backend import backend_for
from mass_ops.context import CycleContext
from mass_ops.evaluation.report.model import LossCurve, ThroughputCurve
from mass_ops.layout import training_prefix
from mass_ops.store.schema import TrainingRun
from mass_ops.train.checkpoints import finite_number, log_rows


def training_runs(ctx: CycleContext) -> list[TrainingRun]:
    """The cycle's training runs in the order they were opened."""
    return ctx.repo.training_runs(ctx.cycle_id)


def _read_log_rows(ctx: CycleContext, run: TrainingRun) -> list[dict[str, Any]]:
    """Rows of the run's training log when it is in the artifact store (log_uri, else the cycle's training
    folder); an unreadable log leaves the curve to the checkpoint rows."""
    keys = []
    if run.log_uri:
        try:
            key = ctx.artifacts.key_of(run.log_uri)
            keys.append(key if key.endswith(".jsonl") else f"{key.rstrip('/')}/train_log.jsonl")
        except ValueError:
            pass
    keys.append(f"{training_prefix(ctx.cycle_name)}/{run.key}/train_log.jsonl")
    for key in keys:
        if ctx.artifacts.exists(key):
            return log_rows(ctx.artifacts.get_bytes(key).decode("utf-8", errors="replace"), key, strict=False)
    return []


def loss_curves(ctx: CycleContext, runs: Sequence[TrainingRun]) -> list[LossCurve]:
    """Per run: its training and validation losses by step and the checkpoint selected (best_checkpoint)."""
    curves = []
    for run in runs:
        train: dict[int, float] = {}
        val: dict[int, float] = {}
        for row in _read_log_rows(ctx, run):
            step = row.get("step")
            if not isinstance(step, int):
                continue
            if finite_number(row.get("val_loss")):
                val[step] = float(row["val_loss"])
            elif finite_number(row.get("loss")):
                train[step] = float(row["loss"])
        for checkpoint in ctx.repo.checkpoints(run.id):
            if checkpoint.val_loss is not None and checkpoint.step not in val:
                val[checkpoint.step] = checkpoint.val_loss
            if checkpoint.train_loss is not None and checkpoint.step not in train:
                train[checkpoint.step] = checkpoint.train_loss
        best = ctx.repo.best_checkpoint(run.id)
        curves.append(
            LossCurve(
                run=run.key,
                train=sorted(train.items()),
                val=sorted(val.items()),
                selected_step=best.step if best else None,
                selected_val_loss=best.val_loss if best else None,
            )
        )
    return curves


def _number(value: Any) -> float | None:
    return float(value) if finite_number(value) else None


def throughput_curves(ctx: CycleContext, runs: Sequence[TrainingRun]) -> list[ThroughputCurve]:
    """The throughput fields the trainer logs per step (runs whose log has none are left out)."""
    curves = []
    for run in runs:
        tokens: list[tuple[int, float]] = []
        supervised: list[tuple[int, float]] = []
        mfu: list[tuple[int, float]] = []
        peaks: list[float] = []
        for row in _read_log_rows(ctx, run):
            step = row.get("step")
            if not isinstance(step, int) or "val_loss" in row:
                continue
            for name, series in (("tokens_per_s", tokens), ("supervised_tokens_per_s", supervised), ("mfu", mfu)):
                value = _number(row.get(name))
                if value is not None:
                    series.append((step, value))
            peak = _number(row.get("peak_mem_gib"))
            if peak is not None:
                peaks.append(peak)
        if tokens:
            curves.append(ThroughputCurve(run.key, tokens, supervised, mfu, max(peaks) if peaks else None))
    return curves


def ran_on_cpu(ctx: CycleContext, runs: Sequence[TrainingRun]) -> bool:
    """Whether the cycle ran on CPUs (the laptop demo), so it has no GPU-hours: a training log row naming its
    `device`, else the trainer's own sign — it drops the GPU peak on a CPU, so its steps log achieved TFLOP/s but no
    MFU although `training.peak_tflops_per_gpu` is set. Clusters (the kubernetes backend) always run on GPUs."""
    if not backend_for(ctx.config).cpu_possible:
        return False
    peak_set = ctx.config.training.peak_tflops_per_gpu is not None
    for run in runs:
        for row in _read_log_rows(ctx, run):
            device = row.get("device")
            if isinstance(device, str):
                return device == "cpu"
            if peak_set and _number(row.get("model_tflops_per_gpu")) is not None and "mfu" in row:
                return row["mfu"] is None
    return False
