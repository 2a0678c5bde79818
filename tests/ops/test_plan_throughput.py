"""`mass-ops plan`'s training time: the tokens/s measured by the parent generation's cycle when its finished training
run is recorded, else the documented default — and the plan says which."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mass_ops.cli import app
from mass_ops.config import CycleConfig, load_config
from mass_ops.layout import training_prefix
from mass_ops.ops.plan import DEFAULT_TRAIN_STEP_S, build_plan, cycle_estimate, measured_throughput
from mass_ops.train.plan import training_command_for
from tests.inner_loop_fakes import migrated_sqlite, open_test_cycle


def _config(tmp_path: Path, generation: int, *extra: str) -> CycleConfig:
    url = f"sqlite:///{tmp_path / 'metadata.db'}"
    return load_config(
        "demo",
        [
            f"storage.metadata_url={url}",
            f"storage.artifact_url={tmp_path / 'artifacts'}",
            f"generation={generation}",
            f"models.served_name=L{generation}",
            *extra,
        ],
        environ={},
    )


def _record_parent(tmp_path: Path, *, register: bool = True, status: str = "succeeded") -> str:
    """Cycle L0 → L1 with a finished training run whose log measured 2 steps: 3 windows of 1 000 tokens at 1 500
    tokens/s (2 s), then 3 windows of 1 000 tokens at 1 000 tokens/s (3 s)."""
    migrated_sqlite(tmp_path / "metadata.db")
    parent = _config(tmp_path, 0)
    ctx = open_test_cycle(parent)
    run = ctx.repo.ensure_training_run(ctx.cycle_id, "sft", {"steps": 2})
    rows = [
        {"step": 0, "val_loss": 2.0},
        {"step": 1, "loss": 2.1, "tokens_per_s": 1500.0, "step_s": 2.0, "windows": 3, "mfu": None},
        {"step": 2, "loss": 2.0, "tokens_per_s": 1000.0, "step_s": 3.0, "windows": 3, "mfu": None},
    ]
    log = ctx.artifacts.put_bytes(
        f"{training_prefix(ctx.cycle_name)}/sft/train_log.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()
    )
    ctx.repo.set_training_run_status(run.id, "running", log_uri=log.uri)
    ctx.repo.set_training_run_status(run.id, status)
    if register:
        ctx.repo.register_generation("L1", 1, bf16_uri="models/L1-bf16", cycle_id=ctx.cycle_id)
    return ctx.cycle_name


def test_the_plan_uses_the_parent_cycles_measured_tokens_per_second(tmp_path: Path) -> None:
    parent = _record_parent(tmp_path)
    config = _config(tmp_path, 1, "training.steps=10")
    plan = build_plan(config, training_command_for(config))
    timing = plan.training_time
    assert timing is not None and timing.measured_cycle == parent
    # 6 000 tokens in 5 s of steps = 1 200 tokens/s; 1 000 tokens per window × this config's windows per step.
    windows = config.training.effective_windows_per_step
    assert timing.tokens_per_s == pytest.approx(1200.0)
    assert timing.tokens_per_step == pytest.approx(1000.0 * windows)
    assert timing.wall_clock_h == pytest.approx(10 * 1000.0 * windows / 1200.0 / 3600)
    assert timing.gpu_hours == pytest.approx(timing.wall_clock_h * config.training.replicas)
    train = next(s for s in plan.stages if s.stage == "train").counts
    assert train["tokens_per_s"] == 1200
    assert train["throughput"] == f"measured on cycle {parent} (run sft, 2 logged steps)"
    # The cost estimate's training time is the same figure.
    estimate = cycle_estimate(config, plan).stage("train")
    assert estimate is not None and estimate.wall_clock_s == pytest.approx(timing.wall_clock_h * 3600)

    shown = CliRunner().invoke(app, ["plan", "--config", "demo", "--json", *_sets(config)])
    assert shown.exit_code == 0, shown.output
    counts = {s["stage"]: s["counts"] for s in json.loads(shown.stdout)["plan"]["stages"]}
    assert counts["train"]["throughput"].startswith(f"measured on cycle {parent}")


def _sets(config: CycleConfig) -> list[str]:
    pairs = {
        "storage.metadata_url": config.storage.metadata_url,
        "storage.artifact_url": config.storage.artifact_url,
        "generation": config.generation,
        "models.served_name": config.models.served_name,
    }
    return [arg for key, value in pairs.items() for arg in ("--set", f"{key}={value}")]


@pytest.mark.parametrize("register,status", [(False, "succeeded"), (True, "failed")])
def test_without_a_finished_parent_run_the_plan_says_it_used_the_default(
    tmp_path: Path, register: bool, status: str
) -> None:
    _record_parent(tmp_path, register=register, status=status)
    config = _config(tmp_path, 1)
    timing = build_plan(config, training_command_for(config)).training_time
    assert timing is not None and timing.measured_cycle is None
    assert timing.step_s == pytest.approx(DEFAULT_TRAIN_STEP_S)
    assert timing.tokens_per_step == config.training.effective_windows_per_step * config.training.window
    assert timing.source.startswith("default: 60 s per step")


def test_a_plan_without_a_metadata_file_creates_none(tmp_path: Path) -> None:
    config = _config(tmp_path, 1)
    assert build_plan(config, training_command_for(config)).training_time.measured_cycle is None  # type: ignore[union-attr]
    assert not (tmp_path / "metadata.db").exists()


def test_rows_without_throughput_measure_nothing() -> None:
    assert (
        measured_throughput("c", "sft", [{"step": 1, "loss": 2.0}, {"step": 2, "tokens_per_s": 0, "step_s": 1}]) is None
    )
