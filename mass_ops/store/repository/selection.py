"""Ranking of the collected episodes and their selection into the training and validation splits."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from mass_ops.store.repository.base import (
    InvalidRecordError,
    RepositoryBase,
    TaskId,
    _member,
    _task,
)
from mass_ops.store.schema import (
    DataSplit,
    Episode,
    Ranking,
    Selection,
)


class SelectionRecords(RepositoryBase):
    """Rows of `rankings` and `selections`; each takes its task from the episode it points at."""

    def _episode_of_cycle(self, session: Session, cycle_id: int, episode_id: int) -> Episode:
        episode = session.get(Episode, episode_id)
        if episode is None or episode.cycle_id != cycle_id:
            raise InvalidRecordError(f"episode {episode_id} does not exist in cycle {cycle_id}")
        return episode

    def record_ranking(
        self,
        cycle_id: int,
        episode_id: int,
        *,
        score: float,
        rank: int,
        ci_low: float | None = None,
        ci_high: float | None = None,
    ) -> Ranking:
        """Score and rank of a collected episode; its task is taken from the episode."""
        with self.store.write() as session:
            episode = self._episode_of_cycle(session, cycle_id, episode_id)
            values = {
                "cycle_id": cycle_id,
                "task_id": episode.task_id,
                "score": score,
                "rank": rank,
                "ci_low": ci_low,
                "ci_high": ci_high,
            }
            return self._insert_once(session, Ranking, {"episode_id": episode_id}, values, must_match=("rank",))

    def rankings(self, cycle_id: int, task_id: TaskId) -> list[Ranking]:
        """A task's ranking, rank 1 (best) first."""
        return self._all(
            sa.select(Ranking)
            .where(Ranking.cycle_id == cycle_id, Ranking.task_id == _task(task_id))
            .order_by(Ranking.rank)
        )

    def cycle_rankings(self, cycle_id: int) -> list[Ranking]:
        """Every task's ranking rows of a cycle, in the order they were recorded."""
        return self._all(sa.select(Ranking).where(Ranking.cycle_id == cycle_id).order_by(Ranking.id))

    def record_selection(
        self, cycle_id: int, episode_id: int, split: str, *, rank: int | None = None, weight: float = 1.0
    ) -> Selection:
        """Select an episode for training or validation; an episode belongs to one split only."""
        with self.store.write() as session:
            episode = self._episode_of_cycle(session, cycle_id, episode_id)
            values = {
                "cycle_id": cycle_id,
                "task_id": episode.task_id,
                "split": _member(DataSplit, split, "data split"),
                "rank": rank,
                "weight": weight,
            }
            return self._insert_once(session, Selection, {"episode_id": episode_id}, values, must_match=("split",))

    def selections(self, cycle_id: int, split: str) -> list[Selection]:
        return self._all(
            sa.select(Selection)
            .where(Selection.cycle_id == cycle_id, Selection.split == _member(DataSplit, split, "data split"))
            .order_by(Selection.task_id, Selection.rank, Selection.id)
        )

    def cycle_selections(self, cycle_id: int) -> list[Selection]:
        """Every selection of a cycle, both splits, in the order they were recorded."""
        return self._all(sa.select(Selection).where(Selection.cycle_id == cycle_id).order_by(Selection.id))
