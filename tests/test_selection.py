"""Train/validation selection from within-task ranks (MASS_SPEC §1 select)."""

from __future__ import annotations

import random

import pytest

from mass_ops.ranking import MatchResult, RankedEntry, bradley_terry, rank, tournament_pairs
from mass_ops.selection import SelectionError, select_trajectories

TRAIN_TASKS = [51, 53, 56, 202, 205, 302, 307, 324]
TEST_TASKS = [60, 207, 305]


def _ranked_pool(task: int, candidates: int = 18, seed: int = 0) -> list[RankedEntry]:
    """A task's candidates ranked by a real tournament + Bradley–Terry fit on random verdicts."""
    names = [f"t{task}_L0_s{710000 + 100 * task + i}" for i in range(candidates)]
    rng = random.Random(seed + task)
    matches = [
        MatchResult.from_verdict(a, b, rng.choice(["A", "B", "tie"]))
        for a, b in tournament_pairs(names, 6, seed=1234 + task)
    ]
    return rank(bradley_terry(names, matches))


def test_paper_selection_gives_120_train_and_8_val_at_rank_16() -> None:
    ranked = {task: _ranked_pool(task) for task in TRAIN_TASKS}
    selection = select_trajectories(ranked, train_ranks=15, validation_rank=16, test_tasks=TEST_TASKS)
    assert selection.train_count == 120
    assert selection.val_count == 8
    assert {item.rank for item in selection.val} == {16}
    assert {item.rank for item in selection.train} == set(range(1, 16))
    assert selection.counts_by_task() == dict.fromkeys(TRAIN_TASKS, (15, 1))
    train_names = {item.episode for item in selection.train}
    val_names = {item.episode for item in selection.val}
    assert len(train_names) == 120 and not train_names & val_names
    for task in TRAIN_TASKS:
        by_rank = {entry.rank: entry for entry in ranked[task]}
        chosen = [item for item in selection.train if item.task == task]
        assert [item.episode for item in chosen] == [by_rank[r].name for r in range(1, 16)]
        assert [item.score for item in chosen] == [by_rank[r].score for r in range(1, 16)]
        (val,) = [item for item in selection.val if item.task == task]
        assert val.episode == by_rank[16].name
    # Ranks 17 and 18 are dropped.
    dropped = {entry.name for task in TRAIN_TASKS for entry in ranked[task] if entry.rank > 16}
    assert len(dropped) == 16 and not dropped & (train_names | val_names)


def test_output_is_ordered_by_task_then_rank() -> None:
    ranked = {task: list(reversed(_ranked_pool(task))) for task in (302, 51)}
    selection = select_trajectories(ranked)
    assert [(item.task, item.rank) for item in selection.train] == [
        (task, r) for task in (51, 302) for r in range(1, 16)
    ]


def test_smaller_settings_follow_the_same_rule() -> None:
    selection = select_trajectories({51: _ranked_pool(51, candidates=5)}, train_ranks=3, validation_rank=4)
    assert [item.rank for item in selection.train] == [1, 2, 3]
    assert [item.rank for item in selection.val] == [4]


def test_too_few_candidates_names_the_task() -> None:
    ranked = {51: _ranked_pool(51), 53: _ranked_pool(53, candidates=15)}
    with pytest.raises(SelectionError, match="task 53: 15 ranked candidates, need at least validation_rank = 16"):
        select_trajectories(ranked)


def test_test_tasks_are_refused() -> None:
    ranked = {51: _ranked_pool(51), 207: _ranked_pool(207)}
    with pytest.raises(SelectionError, match=r"tasks \[207\] are test tasks"):
        select_trajectories(ranked, test_tasks=TEST_TASKS)


def test_an_episode_in_two_tasks_is_refused() -> None:
    shared = _ranked_pool(51)
    with pytest.raises(SelectionError, match="selected more than once"):
        select_trajectories({51: shared, 53: shared})


def test_malformed_rankings_are_refused() -> None:
    pool = _ranked_pool(51)
    gap = [*pool[:-1], RankedEntry(pool[-1].name, pool[-1].score, 20)]
    with pytest.raises(SelectionError, match=r"task 51: ranks must be exactly 1\.\.18"):
        select_trajectories({51: gap})
    twice = [*pool[:-1], RankedEntry(pool[0].name, pool[-1].score, 18)]
    with pytest.raises(SelectionError, match="task 51: episodes ranked more than once"):
        select_trajectories({51: twice})


def test_empty_and_inconsistent_settings_are_refused() -> None:
    with pytest.raises(SelectionError, match="empty selection"):
        select_trajectories({})
    with pytest.raises(SelectionError, match=r"validation_rank \(17\) must equal train_ranks \+ 1 \(16\)"):
        select_trajectories({51: _ranked_pool(51)}, train_ranks=15, validation_rank=17)
    with pytest.raises(SelectionError, match="train_ranks"):
        select_trajectories({51: _ranked_pool(51)}, train_ranks=0, validation_rank=1)
