"""Rendered datasets and the index of their training windows."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from mass_ops.store.repository.base import (
    InvalidRecordError,
    RepositoryBase,
    TaskId,
    _document,
    _member,
    _task,
)
from mass_ops.store.schema import (
    Dataset,
    DataSplit,
    TrainingWindow,
    WindowRole,
)


@dataclass(frozen=True)
class WindowGroup:
    """Windows of one (task, role) group of a dataset: what the task/role sampler draws from."""

    task_id: str
    role: str
    windows: int
    loss_tokens: int


WINDOW_FIELDS = frozenset(
    {
        "position",
        "episode_id",
        "task_id",
        "role",
        "is_main",
        "thread",
        "segment",
        "window_index",
        "n_windows",
        "n_tokens",
        "n_loss_tokens",
        "weight",
    }
)


class DatasetRecords(RepositoryBase):
    """Rows of `datasets` and `training_windows`."""

    def record_dataset(
        self,
        cycle_id: int,
        split: str,
        uri: str,
        *,
        episodes: int,
        windows: int,
        loss_tokens: int,
        total_tokens: int,
        stats: Mapping[str, Any] | None = None,
        tokenizer: str | None = None,
    ) -> Dataset:
        key = {"cycle_id": cycle_id, "split": _member(DataSplit, split, "data split")}
        values = {
            "uri": uri,
            "episodes": episodes,
            "windows": windows,
            "loss_tokens": loss_tokens,
            "total_tokens": total_tokens,
            "stats": _document(stats, "dataset stats"),
            "tokenizer": tokenizer,
        }
        return self._record(Dataset, key, values, must_match=("uri",))

    def get_dataset(self, cycle_id: int, split: str) -> Dataset | None:
        return self._one(
            sa.select(Dataset).where(
                Dataset.cycle_id == cycle_id, Dataset.split == _member(DataSplit, split, "data split")
            )
        )

    def datasets(self, cycle_id: int) -> list[Dataset]:
        """The rendered datasets of a cycle (one per split), in the order they were recorded."""
        return self._all(sa.select(Dataset).where(Dataset.cycle_id == cycle_id).order_by(Dataset.id))

    def record_windows(self, dataset_id: int, windows: Iterable[Mapping[str, Any]]) -> int:
        """Index a dataset's windows in one transaction; windows already indexed (same position) are skipped.

        Each mapping carries the `TrainingWindow` columns (position, task_id, role, is_main, window_index,
        n_windows, n_tokens, n_loss_tokens; optional episode_id, thread, segment, weight). Returns how many windows
        the dataset has indexed afterwards.
        """
        rows: list[dict[str, Any]] = []
        for index, window in enumerate(windows):
            unknown = set(window) - WINDOW_FIELDS
            if unknown:
                raise InvalidRecordError(
                    f"window #{index} of dataset {dataset_id} has unknown fields {sorted(unknown)}"
                )
            row = {"episode_id": None, "thread": None, "segment": None, "weight": 1.0, **window}
            row["dataset_id"] = dataset_id
            row["task_id"] = _task(row["task_id"])
            row["role"] = _member(WindowRole, row["role"], f"window #{index} role")
            rows.append(row)
        # One lock order for every writer: two renders indexing overlapping windows in different orders would
        # otherwise deadlock on Postgres' unique index.
        rows.sort(key=lambda row: row["position"])
        count = sa.select(sa.func.count()).select_from(TrainingWindow).where(TrainingWindow.dataset_id == dataset_id)
        with self.store.write() as session:
            if rows:
                statement = self._dialect_insert(TrainingWindow).on_conflict_do_nothing(
                    index_elements=["dataset_id", "position"]
                )
                try:
                    session.execute(statement, rows)
                except sa.exc.IntegrityError as exc:
                    reason = str(exc.orig).strip().splitlines()[0]
                    raise InvalidRecordError(f"training_windows of dataset {dataset_id}: {reason}") from None
            return int(session.scalar(count) or 0)

    def windows(
        self, dataset_id: int, *, task_id: TaskId | None = None, role: str | None = None
    ) -> list[TrainingWindow]:
        statement = (
            sa.select(TrainingWindow).where(TrainingWindow.dataset_id == dataset_id).order_by(TrainingWindow.position)
        )
        if task_id is not None:
            statement = statement.where(TrainingWindow.task_id == _task(task_id))
        if role is not None:
            statement = statement.where(TrainingWindow.role == _member(WindowRole, role, "window role"))
        return self._all(statement)

    def window_groups(self, dataset_id: int) -> list[WindowGroup]:
        """Window and loss-token counts per (task, role) of a dataset."""
        statement = (
            sa.select(
                TrainingWindow.task_id,
                TrainingWindow.role,
                sa.func.count(),
                sa.func.coalesce(sa.func.sum(TrainingWindow.n_loss_tokens), 0),
            )
            .where(TrainingWindow.dataset_id == dataset_id)
            .group_by(TrainingWindow.task_id, TrainingWindow.role)
            .order_by(TrainingWindow.task_id, TrainingWindow.role)
        )
        with self.store.read() as session:
            rows = session.execute(statement).all()
        return [WindowGroup(task, role, int(n), int(loss)) for task, role, n, loss in rows]
