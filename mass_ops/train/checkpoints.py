"""Checkpoint layout and selection (MASS_SPEC §1 export, §8).

A run directory holds `train_log.jsonl` and one `step_{NNNNN}/` per saved step:
`lora_state_dict.safetensors` (fp32 LoRA tensors, PEFT parameter names), `adapter/` (PEFT adapter_config.json +
adapter_model.safetensors), `engine/` (DeepSpeed ZeRO-3 partitions of adapters and optimizer, per rank) and
`train_state.json`, written last. Selection takes the minimum validation loss over saved steps > 0; step 0 (before
any update) is never a candidate. This module needs no torch: the export and metadata stages import it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mass_ops.errors import InputError

CRITERION = "minimum validation loss"
LORA_STATE_FILE = "lora_state_dict.safetensors"
ADAPTER_DIR = "adapter"
ENGINE_DIR = "engine"
TRAIN_STATE_FILE = "train_state.json"
TRAIN_LOG_FILE = "train_log.jsonl"
SELECTION_FILE = "selected_checkpoint.json"


class CheckpointSelectionError(InputError):
    """The training log or checkpoints do not allow a choice; the message says which row or file and why."""


def checkpoint_dir(out_dir: str | Path, step: int) -> Path:
    """`<out_dir>/step_{step:05d}`."""
    return Path(out_dir) / f"step_{step:05d}"


def is_complete(step_dir: str | Path) -> bool:
    """A checkpoint counts once its adapters and its train_state.json (written last) are both present."""
    step_dir = Path(step_dir)
    return (step_dir / LORA_STATE_FILE).is_file() and (step_dir / TRAIN_STATE_FILE).is_file()


@dataclass(frozen=True)
class SelectedCheckpoint:
    step: int
    val_loss: float
    checkpoint_dir: Path
    criterion: str = CRITERION

    def to_dict(self) -> dict[str, Any]:
        """The reference's `selected_checkpoint.json` fields."""
        return {
            "step": self.step,
            "val_loss": self.val_loss,
            "checkpoint": str(self.checkpoint_dir),
            "criterion": self.criterion,
        }


@dataclass(frozen=True)
class CheckpointRecord:
    """One saved step, for metadata rows: where it is and the losses logged at that step (None when not logged)."""

    step: int
    checkpoint_dir: Path
    train_loss: float | None
    val_loss: float | None
    val_tokens: int | None


def finite_number(value: Any) -> bool:
    """A real, finite number (not a bool): what a logged loss or token count must be to count."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def log_rows(text: str, where: str, *, strict: bool = True, complete_lines_only: bool = False) -> list[dict[str, Any]]:
    """The JSON-object rows of a JSONL training log, each with its line number under `_line`; the one reader of
    the trainer's logs. `strict`: a line that is not a JSON object is a CheckpointSelectionError naming `where:line`
    (else it is skipped, for a report that shows what it can). `complete_lines_only`: a last line without its newline
    is not read (the trainer may still be writing it)."""
    rows = []
    for line_no, line in enumerate(text.splitlines(keepends=True), start=1):
        if complete_lines_only and not line.endswith("\n"):
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if strict:
                raise CheckpointSelectionError(f"{where}:{line_no}: not valid JSON ({exc.msg})") from None
            continue
        if not isinstance(row, dict):
            if strict:
                raise CheckpointSelectionError(f"{where}:{line_no}: a log row must be a JSON object")
            continue
        row["_line"] = line_no
        rows.append(row)
    return rows


def read_train_log(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a JSONL training log; a bad line is an error naming file:line."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointSelectionError(f"{path}: training log not found")
    return log_rows(path.read_text(encoding="utf-8"), str(path))


def _validation_rows(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for row in rows:
        if "val_loss" not in row:
            continue
        where = f"{path}:{row['_line']}"
        loss, tokens, step = row.get("val_loss"), row.get("val_tokens"), row.get("step")
        if not finite_number(loss):
            raise CheckpointSelectionError(f"{where}: validation loss at step {step} is not finite ({loss!r})")
        if isinstance(tokens, bool) or not isinstance(tokens, int | float) or tokens <= 0:
            raise CheckpointSelectionError(f"{where}: validation at step {step} counted no tokens ({tokens!r})")
        found.append(row)
    return found


def select_checkpoint(train_log_path: str | Path, out_dir: str | Path) -> SelectedCheckpoint:
    """Minimum (val_loss, step) over validation rows with an integer step > 0 whose checkpoint was saved.

    Raises `CheckpointSelectionError` for a non-finite validation loss or a validation without tokens (any row,
    step 0 included), or when no saved step was validated.
    """
    path = Path(train_log_path)
    rows = _validation_rows(path, read_train_log(path))
    candidates = []
    for row in rows:
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
            continue
        if not (checkpoint_dir(out_dir, step) / LORA_STATE_FILE).is_file():
            continue
        candidates.append((float(row["val_loss"]), step))
    if not candidates:
        raise CheckpointSelectionError(
            f"{path}: no validated step > 0 has a saved checkpoint under {out_dir} ({len(rows)} validation rows)"
        )
    val_loss, step = min(candidates)
    return SelectedCheckpoint(step=step, val_loss=val_loss, checkpoint_dir=checkpoint_dir(out_dir, step))


def write_selection(selected: SelectedCheckpoint, path: str | Path) -> Path:
    """Record the choice as `selected_checkpoint.json` (atomic: temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(selected.to_dict(), indent=2) + "\n")
    tmp.replace(path)
    return path


def saved_checkpoints(out_dir: str | Path, train_log_path: str | Path | None = None) -> list[CheckpointRecord]:
    """Complete checkpoints under `out_dir` in step order, joined with the losses logged at their steps."""
    out_dir = Path(out_dir)
    log = Path(train_log_path) if train_log_path is not None else out_dir / TRAIN_LOG_FILE
    train_loss: dict[int, float] = {}
    validation: dict[int, dict[str, Any]] = {}
    if log.is_file():
        for row in read_train_log(log):
            step = row.get("step")
            if not isinstance(step, int):
                continue
            if "val_loss" in row:
                validation[step] = row
            elif "loss" in row:
                train_loss[step] = row["loss"]
    records = []
    for child in sorted(out_dir.glob("step_[0-9][0-9][0-9][0-9][0-9]")):
        if not child.is_dir() or not is_complete(child):
            continue
        step = int(child.name.removeprefix("step_"))
        val = validation.get(step, {})
        records.append(
            CheckpointRecord(
                step=step,
                checkpoint_dir=child,
                train_loss=train_loss.get(step),
                val_loss=val.get("val_loss"),
                val_tokens=val.get("val_tokens"),
            )
        )
    return records
