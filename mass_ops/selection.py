"""Teacher-trajectory selection: ranks 1..train_ranks → train, validation_rank → validation (MASS_SPEC §1 select).

Pure functions over ranked candidates; the stage layer reads eligible tasks and rankings from the store and
persists the result.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from mass_ops.errors import InputError
from mass_ops.ranking import RankedEntry


class SelectionError(InputError):
    """The ranked candidates cannot be split into train and validation trajectories."""


@dataclass(frozen=True)
class SelectedEpisode:
    """One selected trajectory: its task, episode name and within-task rank/score."""

    task: int
    episode: str
    rank: int
    score: float


@dataclass(frozen=True)
class Selection:
    """Train and validation trajectories, ordered by (task, rank)."""

    train: tuple[SelectedEpisode, ...]
    val: tuple[SelectedEpisode, ...]

    @property
    def train_count(self) -> int:
        return len(self.train)

    @property
    def val_count(self) -> int:
        return len(self.val)

    def counts_by_task(self) -> dict[int, tuple[int, int]]:
        """(train, val) trajectory counts per task."""
        train = Counter(item.task for item in self.train)
        val = Counter(item.task for item in self.val)
        return {task: (train[task], val[task]) for task in sorted(set(train) | set(val))}


def _check_ranks(task: int, entries: Sequence[RankedEntry]) -> None:
    ranks = sorted(entry.rank for entry in entries)
    if ranks != list(range(1, len(entries) + 1)):
        raise SelectionError(f"task {task}: ranks must be exactly 1..{len(entries)}, got {ranks}")
    names = Counter(entry.name for entry in entries)
    repeated = sorted(name for name, count in names.items() if count > 1)
    if repeated:
        raise SelectionError(f"task {task}: episodes ranked more than once: {repeated}")


def select_trajectories(
    ranked: Mapping[int, Sequence[RankedEntry]],
    *,
    train_ranks: int = 15,
    validation_rank: int = 16,
    test_tasks: Collection[int] = (),
) -> Selection:
    """Split each task's ranking: ranks 1..train_ranks → train, rank validation_rank → val, the rest dropped.

    `ranked` holds only the eligible tasks (those whose retained workflow beat the reference). Raises
    SelectionError when validation_rank != train_ranks + 1, a task is a test task, a task has fewer than
    validation_rank ranked candidates, an episode would be selected twice, or nothing is selected.
    """
    if isinstance(train_ranks, bool) or not isinstance(train_ranks, int) or train_ranks < 1:
        raise SelectionError(f"train_ranks must be an integer ≥ 1, got {train_ranks!r}")
    if validation_rank != train_ranks + 1:
        raise SelectionError(f"validation_rank ({validation_rank!r}) must equal train_ranks + 1 ({train_ranks + 1})")
    leaked = sorted(set(ranked) & set(test_tasks))
    if leaked:
        raise SelectionError(f"tasks {leaked} are test tasks and cannot supply training trajectories")
    train: list[SelectedEpisode] = []
    val: list[SelectedEpisode] = []
    for task in sorted(ranked):
        entries = list(ranked[task])
        if len(entries) < validation_rank:
            raise SelectionError(
                f"task {task}: {len(entries)} ranked candidates, need at least validation_rank = {validation_rank}"
            )
        _check_ranks(task, entries)
        for entry in sorted(entries, key=lambda item: item.rank):
            chosen = SelectedEpisode(task=task, episode=entry.name, rank=entry.rank, score=entry.score)
            if entry.rank <= train_ranks:
                train.append(chosen)
            elif entry.rank == validation_rank:
                val.append(chosen)
    chosen_twice = sorted(name for name, count in Counter(item.episode for item in train + val).items() if count > 1)
    if chosen_twice:
        raise SelectionError(f"episodes selected more than once (across tasks or splits): {chosen_twice}")
    if not train or not val:
        raise SelectionError(
            f"empty selection: {len(train)} train and {len(val)} validation trajectories from tasks {sorted(ranked)}"
        )
    return Selection(train=tuple(train), val=tuple(val))
