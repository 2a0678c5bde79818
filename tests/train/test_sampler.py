"""The task_role sampler (seeded per draw, p_orch, task-uniform) and loading of window files."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from mass_ops.train.data import WindowDataError, load_windows
from mass_ops.train.sampler import NONMAIN, ORCH, Exposure, TaskRoleSampler, WindowTag, draw_index
from tests.support.train import window_record, write_jsonl


def _tags(spec: dict[int, tuple[int, int]]) -> list[WindowTag]:
    """spec: task → (orchestrator windows, worker windows)."""
    tags = []
    for task, (n_orch, n_worker) in spec.items():
        for role, n in (("orchestrator", n_orch), ("worker", n_worker)):
            tags.extend(WindowTag(index=len(tags) + i, task=task, role=role) for i in range(n))
    return [WindowTag(index=i, task=t.task, role=t.role) for i, t in enumerate(tags)]


def test_draws_are_a_pure_function_of_seed_rank_and_draw_index() -> None:
    tags = _tags({51: (3, 9), 202: (2, 5), 305: (0, 4)})
    a = TaskRoleSampler(tags, seed=1234, p_orch=1 / 3)
    b = TaskRoleSampler(list(tags), seed=1234, p_orch=1 / 3)  # another process, same file
    for step in range(40):
        for rank in range(3):
            first = a.draw(step=step, rank=rank, micro=0, grad_accum=1)
            second = b.draw(step=step, rank=rank, micro=0, grad_accum=1)
            assert first == second
    # draw = step·grad_accum + micro: (step 3, micro 1, accum 2) is draw 7, the same as (step 7, micro 0, accum 1).
    assert draw_index(3, 1, 2) == 7
    assert a.draw(step=3, rank=1, micro=1, grad_accum=2).window == a.draw(step=7, rank=1, micro=0, grad_accum=1).window
    ranks = [[a.draw(step=s, rank=r, micro=0, grad_accum=1).window for s in range(50)] for r in range(2)]
    assert ranks[0] != ranks[1]
    other_seed = TaskRoleSampler(tags, seed=1235, p_orch=1 / 3)
    assert [other_seed.draw(step=s, rank=0, micro=0, grad_accum=1).window for s in range(50)] != ranks[0]


def test_task_is_drawn_from_a_string_seeded_rng() -> None:
    tags = _tags({53: (1, 1), 51: (1, 1), 60: (1, 0)})
    sampler = TaskRoleSampler(tags, seed=99, p_orch=0.5)
    for n in range(30):
        expected_task = sorted({51, 53, 60})[random.Random(f"99-2-{n}").randrange(3)]
        assert sampler.draw(step=n, rank=2, micro=0, grad_accum=1).task == expected_task


def test_orchestrator_share_follows_p_orch_only_where_both_groups_exist() -> None:
    tags = _tags({51: (2, 30), 60: (5, 0), 305: (0, 7)})
    sampler = TaskRoleSampler(tags, seed=1234, p_orch=1 / 3)
    draws = [sampler.draw(step=s, rank=0, micro=0, grad_accum=1) for s in range(12000)]
    by_task = Counter(d.task for d in draws)
    for task in (51, 60, 305):  # uniform over tasks, not over windows (51 holds most windows)
        assert abs(by_task[task] / len(draws) - 1 / 3) < 0.02
    mixed = [d for d in draws if d.task == 51]
    share = sum(d.group == ORCH for d in mixed) / len(mixed)
    assert abs(share - 1 / 3) < 0.03  # ~4000 draws: 3σ ≈ 0.022
    assert {d.group for d in draws if d.task == 60} == {ORCH}  # only orchestrator windows
    assert {d.group for d in draws if d.task == 305} == {NONMAIN}
    windows_51 = Counter(d.window for d in mixed if d.group == NONMAIN)
    assert len(windows_51) == 30  # every worker window of the task gets drawn


def test_p_orch_extremes_and_group_of_roles() -> None:
    tags = _tags({51: (3, 3)})
    never = TaskRoleSampler(tags, seed=1, p_orch=0.0)
    always = TaskRoleSampler(tags, seed=1, p_orch=1.0)
    assert {never.draw(step=s, rank=0, micro=0, grad_accum=1).group for s in range(200)} == {NONMAIN}
    assert {always.draw(step=s, rank=0, micro=0, grad_accum=1).group for s in range(200)} == {ORCH}
    assert WindowTag(0, 51, "auxiliary").group == NONMAIN and WindowTag(0, 51, "orchestrator").group == ORCH
    with pytest.raises(ValueError, match="no training windows"):
        TaskRoleSampler([], seed=1, p_orch=0.5)


def test_exposure_counts_round_trip() -> None:
    sampler = TaskRoleSampler(_tags({51: (2, 2), 53: (0, 3)}), seed=5, p_orch=0.5)
    exposure = Exposure()
    for step in range(10):
        exposure.add(sampler.draws_for_step(step=step, rank=0, grad_accum=3))
    assert exposure.draws == 30 and sum(exposure.by_task_role.values()) == 30
    restored = Exposure.from_dict(json.loads(json.dumps(exposure.to_dict())))
    assert restored == exposure


# ---------------------------------------------------------------------------------------------------------------------
# window files


def test_label_free_windows_are_dropped_at_load(tmp_path: Path) -> None:
    rows = [
        window_record([1, 2, 3, 4], [-100, -100, 3, 4], task=51, role="orchestrator", episode="e1"),
        # Only the first position is labelled: nothing to predict after the shift, so it is dropped.
        window_record([5, 6, 7], [5, -100, -100], task=51, role="worker", episode="e2"),
        window_record([8, 9], [-100, 9], task=53, role="auxiliary", episode="e3"),
    ]
    loaded = load_windows(write_jsonl(tmp_path / "w.jsonl", rows), vocab_size=16)
    assert len(loaded) == 2 and loaded.dropped_unsupervised == 1
    assert [w.episode for w in loaded.windows] == ["e1", "e3"]
    assert [w.index for w in loaded.windows] == [0, 1]  # sampler indices are positions in the kept list
    assert [w.line for w in loaded.windows] == [1, 3]
    assert loaded.loss_tokens == 3 and loaded.windows[0].n_loss_tokens == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"labels": [-100, 2]}, "differ in length"),
        ({"input_ids": [1, 2.5, 3]}, "flat list of integers"),
        ({"input_ids": [1, 99, 3]}, "outside the vocabulary"),
        ({"labels": [-100, 77, 3]}, "labels must be"),
        ({"role": "judge"}, "'role' must be one of"),
        ({"task": "51"}, "'task' must be an integer"),
        ({"episode": ""}, "'episode' must be a non-empty string"),
    ],
)
def test_bad_windows_name_file_and_line(tmp_path: Path, change: dict, message: str) -> None:
    good = window_record([1, 2, 3], [-100, 2, 3], task=51, role="worker", episode="e")
    path = write_jsonl(tmp_path / "w.jsonl", [good, {**good, **change}])
    with pytest.raises(WindowDataError, match=message) as error:
        load_windows(path, vocab_size=16)
    assert f"{path}:2:" in str(error.value)


def test_missing_fields_empty_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(WindowDataError, match="missing fields"):
        load_windows(write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1], "labels": [1]}]))
    (tmp_path / "b.jsonl").write_text("{not json\n")
    with pytest.raises(WindowDataError, match=r"b\.jsonl:1: not valid JSON"):
        load_windows(tmp_path / "b.jsonl")
    only_masked = window_record([1, 2], [-100, -100], task=51, role="worker", episode="e")
    with pytest.raises(WindowDataError, match="no window with supervised tokens"):
        load_windows(write_jsonl(tmp_path / "c.jsonl", [only_masked]))
    with pytest.raises(WindowDataError, match="not found"):
        load_windows(tmp_path / "missing.jsonl")
