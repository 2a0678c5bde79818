"""Training runs and their checkpoints (adapter, losses), with the checkpoint that wins on validation loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from mass_ops.store.repository.base import (
    InvalidRecordError,
    RepositoryBase,
    _document,
    _member,
    _sha256,
)
from mass_ops.store.schema import (
    Checkpoint,
    RunStatus,
    TrainingRun,
    utcnow,
)


class TrainingRecords(RepositoryBase):
    """Rows of `training_runs` and `checkpoints`."""

    def ensure_training_run(self, cycle_id: int, key: str, args: Mapping[str, Any]) -> TrainingRun:
        """The training run `key` of a cycle, created on first call; other `args` under the same key conflict."""
        values = {"args": _document(args, "training args"), "status": RunStatus.PENDING.value, "created_at": utcnow()}
        return self._record(TrainingRun, {"cycle_id": cycle_id, "key": key}, values, must_match=("args",))

    def set_training_run_status(
        self,
        run_id: int,
        status: str,
        *,
        log_uri: str | None = None,
        output_uri: str | None = None,
        log_sha256: str | None = None,
    ) -> TrainingRun:
        """Move a run to `status`; running stamps `started_at` once, finishing states stamp `finished_at`.
        `log_sha256` is the hash the log at `log_uri` was published with."""
        status = _member(RunStatus, status, "training run status")
        log_sha256 = _sha256(log_sha256, "training run log_sha256")
        with self.store.write() as session:
            run = session.get(TrainingRun, run_id)
            if run is None:
                raise InvalidRecordError(f"training run {run_id} does not exist")
            run.status = status
            now = utcnow()
            if status == RunStatus.RUNNING and run.started_at is None:
                run.started_at = now
            if status in (RunStatus.SUCCEEDED, RunStatus.FAILED):
                run.finished_at = now
            if log_uri is not None:
                run.log_uri = log_uri
                run.log_sha256 = log_sha256
            elif log_sha256 is not None:
                run.log_sha256 = log_sha256
            if output_uri is not None:
                run.output_uri = output_uri
            return run

    def record_checkpoint(
        self,
        run_id: int,
        step: int,
        *,
        uri: str | None = None,
        train_loss: float | None = None,
        val_loss: float | None = None,
        val_tokens: int | None = None,
        sha256: str | None = None,
    ) -> Checkpoint:
        """A step's adapter (`uri`, published with `sha256`) and/or validation result. Later calls for the same
        step fill fields still empty, so a checkpoint save and the validation at that step may be recorded in
        either order; a different value for a filled field raises UnitConflictError.
        """
        given = {
            "uri": uri,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "val_tokens": val_tokens,
            "sha256": _sha256(sha256, "checkpoint sha256"),
        }
        with self.store.write() as session:
            checkpoint = self._insert_once(
                session, Checkpoint, {"run_id": run_id, "step": step}, given, must_match=tuple(given)
            )
            for field, value in given.items():
                if value is not None and getattr(checkpoint, field) is None:
                    setattr(checkpoint, field, value)
            return checkpoint

    def training_runs(self, cycle_id: int) -> list[TrainingRun]:
        """Every training run of a cycle, in the order they were created."""
        return self._all(sa.select(TrainingRun).where(TrainingRun.cycle_id == cycle_id).order_by(TrainingRun.id))

    def get_training_run(self, cycle_id: int, key: str) -> TrainingRun | None:
        """The cycle's training run `key`, or None; reading never creates it (unlike `ensure_training_run`)."""
        return self._one(sa.select(TrainingRun).where(TrainingRun.cycle_id == cycle_id, TrainingRun.key == key))

    def checkpoints(self, run_id: int) -> list[Checkpoint]:
        return self._all(sa.select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step))

    def best_checkpoint(self, run_id: int) -> Checkpoint | None:
        """The saved checkpoint with the lowest validation loss, ties to the earlier step; step 0 never counts."""
        return self._one(
            sa.select(Checkpoint)
            .where(
                Checkpoint.run_id == run_id,
                Checkpoint.step > 0,
                Checkpoint.uri.is_not(None),
                Checkpoint.val_loss.is_not(None),
            )
            .order_by(Checkpoint.val_loss, Checkpoint.step)
            .limit(1)
        )
