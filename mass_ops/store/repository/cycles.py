"""Cycles and their tasks: the frozen config of a cycle, its provenance, status and task list."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from mass_ops.store.repository.base import (
    ConfigChangedError,
    InvalidRecordError,
    RepositoryBase,
    TaskId,
    UnitConflictError,
    _document,
    _member,
    _task,
)
from mass_ops.store.schema import (
    Cycle,
    CycleTask,
    RunStatus,
    TaskSplit,
    utcnow,
)


class CycleRecords(RepositoryBase):
    """Rows of `cycles` and `cycle_tasks`."""

    def ensure_cycle(
        self,
        name: str,
        config: Mapping[str, Any],
        config_hash: str,
        *,
        generation: int = 0,
        preset: str | None = None,
        parent_model: str | None = None,
    ) -> Cycle:
        """The cycle called `name`, created on first call; its config is frozen from then on.

        Raises ConfigChangedError when the cycle exists with another config hash.
        """
        now = utcnow()
        values = {
            "generation": generation,
            "preset": preset,
            "parent_model": parent_model,
            "config": _document(config, "cycle config"),
            "config_hash": config_hash,
            "status": RunStatus.PENDING.value,
            "created_at": now,
            "updated_at": now,
        }
        with self.store.write() as session:
            cycle = self._insert_once(session, Cycle, {"name": name}, values)
        if cycle.config_hash != config_hash:
            raise ConfigChangedError(
                f"cycle {name!r} was frozen with config hash {cycle.config_hash[:12]}…, this config hashes to "
                f"{config_hash[:12]}…; use a new cycle name to run a changed config"
            )
        return cycle

    def get_cycle(self, name: str) -> Cycle | None:
        return self._one(sa.select(Cycle).where(Cycle.name == name))

    def get_cycle_by_id(self, cycle_id: int) -> Cycle | None:
        return self._one(sa.select(Cycle).where(Cycle.id == cycle_id))

    def set_cycle_provenance(self, cycle_id: int, key: str, value: Any) -> Cycle:
        """Record what the cycle ran with under `key` of its provenance (the task catalogue's identity, the SHA-256 of
        each prompt template, …). A key once recorded never changes: a different value is a UnitConflictError (the
        same cycle name with other tasks or prompts would mix two experiments)."""
        with self.store.write() as session:
            cycle = session.get(Cycle, cycle_id)
            if cycle is None:
                raise InvalidRecordError(f"cycle {cycle_id} does not exist")
            recorded = dict(cycle.provenance or {})
            if key in recorded and recorded[key] != value:
                raise UnitConflictError(
                    f"cycle {cycle.name!r} recorded its {key} as {recorded[key]!r}; this run has {value!r}: use a new "
                    "cycle name to run with another one"
                )
            recorded[key] = value
            cycle.provenance = recorded
            return cycle

    def set_cycle_status(self, cycle_id: int, status: str) -> Cycle:
        """Move a cycle to `status`; finishing states stamp `finished_at`."""
        status = _member(RunStatus, status, "cycle status")
        with self.store.write() as session:
            cycle = session.get(Cycle, cycle_id)
            if cycle is None:
                raise InvalidRecordError(f"cycle {cycle_id} does not exist")
            cycle.status = status
            cycle.updated_at = utcnow()
            if status in (RunStatus.SUCCEEDED, RunStatus.FAILED):
                cycle.finished_at = cycle.updated_at
            return cycle

    def record_cycle_task(
        self,
        cycle_id: int,
        task_id: TaskId,
        split: str,
        *,
        excluded: bool = False,
        exclusion_reason: str | None = None,
        bare_prompt_sha256: str | None = None,
        initial_prompt_sha256: str | None = None,
    ) -> CycleTask:
        values = {
            "split": _member(TaskSplit, split, "task split"),
            "excluded": excluded,
            "exclusion_reason": exclusion_reason,
            "bare_prompt_sha256": bare_prompt_sha256,
            "initial_prompt_sha256": initial_prompt_sha256,
        }
        key = {"cycle_id": cycle_id, "task_id": _task(task_id)}
        return self._record(
            CycleTask, key, values, must_match=("split", "excluded", "bare_prompt_sha256", "initial_prompt_sha256")
        )

    def cycle_tasks(self, cycle_id: int, *, split: str | None = None) -> list[CycleTask]:
        statement = sa.select(CycleTask).where(CycleTask.cycle_id == cycle_id).order_by(CycleTask.id)
        if split is not None:
            statement = statement.where(CycleTask.split == _member(TaskSplit, split, "task split"))
        return self._all(statement)
