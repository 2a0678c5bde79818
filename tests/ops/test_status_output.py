"""What `mass-ops status` prints off a terminal (80 columns, a pipe), and how a finished cycle reads: finished, with
per-stage durations that stop at each stage's last record."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

from mass_ops.ops.status import UnitState, _Spend, _stage_status, cycle_state
from tests.inner_loop_fakes import InnerLoopEnv, inner_loop_fixture  # noqa: F401
from tests.ops.test_status import TASK, collected_with_one_failure, config_file
from tests.test_cli import long_lines, run_cli

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def test_status_through_a_pipe_fits_80_columns_and_names_its_store_whole(
    inner_loop: InnerLoopEnv, tmp_path: Path
) -> None:
    opened = collected_with_one_failure(inner_loop)
    done = run_cli("status", opened.ctx.cycle_name, "--config", config_file(opened, tmp_path))
    assert done.returncode == 0, done.stderr
    assert long_lines(done.stdout) == [], done.stdout
    lines = done.stdout.splitlines()
    store = opened.config.storage.metadata_url
    assert f"metadata store: {store}" in lines or f"  {store}" in lines, "the store's URL whole on one line"
    assert f"cycle {opened.ctx.cycle_name}: in progress" in done.stdout
    assert f"collect: collection-t{TASK}-c1 failed (attempt 2 infra_failure)" in done.stdout


def test_repair_through_a_pipe_fits_80_columns(inner_loop: InnerLoopEnv, tmp_path: Path) -> None:
    opened = collected_with_one_failure(inner_loop)
    done = run_cli("repair", opened.ctx.cycle_name, "--config", config_file(opened, tmp_path), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert long_lines(done.stdout) == [], done.stdout


def test_a_cycle_whose_units_are_all_done_is_finished_and_its_stage_clock_stops():
    row = SimpleNamespace(status="pending")
    done = [UnitState("train", "train-run", "done", finished_at=T0 + timedelta(minutes=5))]
    assert cycle_state(row, done) == "finished"  # the row is never marked: the units decide
    assert cycle_state(row, [*done, UnitState("evaluate", "evaluate-pairwise", "pending")]) == "in progress"
    assert cycle_state(row, [UnitState("evaluate", "evaluate-pairwise", "pending")]) == "not started"
    spend = _Spend(starts=[T0], ends=[T0 + timedelta(minutes=4)])
    soon = _stage_status("train", done, spend, T0 + timedelta(hours=1), "")
    later = _stage_status("train", done, spend, T0 + timedelta(days=3), "")
    assert soon.elapsed_s == later.elapsed_s == 300
