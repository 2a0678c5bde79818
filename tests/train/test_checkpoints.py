"""Checkpoint selection: minimum validation loss over saved steps > 0, the reference's errors, the recorded choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mass_ops.train.checkpoints import (
    CRITERION,
    CheckpointSelectionError,
    checkpoint_dir,
    saved_checkpoints,
    select_checkpoint,
    write_selection,
)


def _log(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _save(out: Path, *steps: int, complete: bool = True) -> None:
    for step in steps:
        d = checkpoint_dir(out, step)
        d.mkdir(parents=True)
        (d / "lora_state_dict.safetensors").write_bytes(b"x")
        if complete:
            (d / "train_state.json").write_text(json.dumps({"step": step}))


def _val(step: int, loss: float, tokens: int = 1000) -> dict:
    return {"step": step, "val_loss": loss, "val_tokens": tokens, "val_by_role": {}, "val_seconds": 1.0}


def test_reference_case_ignores_step_0_and_unsaved_steps(tmp_path: Path) -> None:
    # Step 0 has the lowest loss (it is never a candidate) and step 450 beats 300 but was never saved.
    log = _log(
        tmp_path / "train_log.jsonl",
        [
            _val(0, 0.50),
            {"step": 1, "loss": 2.0, "lr": 1e-5},
            _val(150, 0.90),
            _val(300, 0.70),
            _val(450, 0.60),
            {"step": 450, "loss": 0.8, "lr": 1e-5},
        ],
    )
    _save(tmp_path, 150, 300)
    chosen = select_checkpoint(log, tmp_path)
    assert (chosen.step, chosen.val_loss, chosen.criterion) == (300, 0.70, CRITERION)
    assert chosen.checkpoint_dir == tmp_path / "step_00300"


def test_ties_go_to_the_earlier_step(tmp_path: Path) -> None:
    log = _log(tmp_path / "train_log.jsonl", [_val(150, 0.7), _val(300, 0.7), _val(450, 0.9)])
    _save(tmp_path, 150, 300, 450)
    assert select_checkpoint(log, tmp_path).step == 150


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (_val(150, float("nan")), "not finite"),
        (_val(150, float("inf")), "not finite"),
        (_val(150, 0.5, tokens=0), "counted no tokens"),
        (_val(0, 0.5, tokens=0), "counted no tokens"),  # step 0 is checked too, though never chosen
    ],
)
def test_non_finite_losses_and_empty_validations_are_errors(tmp_path: Path, row: dict, message: str) -> None:
    log = _log(tmp_path / "train_log.jsonl", [_val(300, 0.7), row])
    _save(tmp_path, 150, 300)
    with pytest.raises(CheckpointSelectionError, match=message) as error:
        select_checkpoint(log, tmp_path)
    assert "train_log.jsonl:2" in str(error.value)


def test_no_candidate_and_unreadable_logs_are_errors(tmp_path: Path) -> None:
    log = _log(tmp_path / "train_log.jsonl", [_val(0, 0.5), _val(150, 0.7)])
    with pytest.raises(CheckpointSelectionError, match="no validated step > 0 has a saved checkpoint"):
        select_checkpoint(log, tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"step": 1}\n{oops\n')
    with pytest.raises(CheckpointSelectionError, match=r"bad\.jsonl:2: not valid JSON"):
        select_checkpoint(tmp_path / "bad.jsonl", tmp_path)
    with pytest.raises(CheckpointSelectionError, match="training log not found"):
        select_checkpoint(tmp_path / "absent.jsonl", tmp_path)


def test_the_choice_is_recorded(tmp_path: Path) -> None:
    log = _log(tmp_path / "train_log.jsonl", [_val(150, 0.8), _val(300, 0.7)])
    _save(tmp_path, 150, 300)
    path = write_selection(select_checkpoint(log, tmp_path), tmp_path / "selected_checkpoint.json")
    assert json.loads(path.read_text()) == {
        "step": 300,
        "val_loss": 0.7,
        "checkpoint": str(tmp_path / "step_00300"),
        "criterion": "minimum validation loss",
    }
    assert not list(tmp_path.glob("*.tmp*"))


def test_saved_checkpoints_lists_complete_steps_with_their_losses(tmp_path: Path) -> None:
    _log(tmp_path / "train_log.jsonl", [{"step": 50, "loss": 1.5}, _val(50, 1.2), {"step": 100, "loss": 1.1}])
    _save(tmp_path, 50, 100)
    _save(tmp_path, 150, complete=False)  # interrupted before train_state.json: not a checkpoint
    records = saved_checkpoints(tmp_path)
    assert [(r.step, r.train_loss, r.val_loss, r.val_tokens) for r in records] == [
        (50, 1.5, 1.2, 1000),
        (100, 1.1, None, None),
    ]
