"""Which tasks play which part of a cycle: searched, trained on, held out, excluded; and the task catalogue."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from mass_ops.config.section import Section, TaskList

CATALOGUE_NOT_CHOSEN = (
    "config: tasks.catalogue: not chosen; the paper presets are meant for the reference's tasks, which mass-ops "
    "cannot ship: import them with `mass-ops tasks import <reference>/tasks --dest DIR` and pass "
    "`--set tasks.catalogue=DIR`, or pass `--set tasks.catalogue=builtin` to run the paper's settings on mass-ops' "
    "own 12 tasks"
)


class TasksConfig(Section):
    """Which tasks play which part. `catalogue` = 'builtin', a MASS-format task directory, or null (not chosen yet:
    the paper presets leave it to the user, and no stage runs until it is set)."""

    catalogue: Annotated[str, Field(min_length=1)] | None = Field(
        default="builtin",
        description=(
            "Task catalogue: 'builtin' (mass-ops' own 12 tasks), a directory written by `mass-ops tasks import`, "
            "or null when not chosen yet (the paper presets: validate and every stage refuse to run until it is "
            "set)."
        ),
    )
    train_candidates: TaskList = Field(
        description=(
            "Task ids that workflow search runs on: every designated training task, excluded ones included; must "
            "equal train ∪ excluded. Reference: 9 tasks."
        ),
    )
    train: TaskList = Field(
        description="Task ids whose teacher trajectories are collected, ranked and trained on. Reference: 8 tasks.",
    )
    test: TaskList = Field(
        description="Held-out task ids: searched and evaluated, never trained on. Reference: 60, 207, 305.",
    )
    excluded: TaskList = Field(
        default=[],
        description="Training candidates kept out of teacher collection (searched, not trained on). Reference: [221].",
    )

    @model_validator(mode="after")
    def _splits(self) -> TasksConfig:
        problems = []
        for name in ("train_candidates", "train", "test", "excluded"):
            ids = getattr(self, name)
            dupes = sorted({i for i in ids if ids.count(i) > 1})
            if dupes:
                problems.append(f"{name}: lists {dupes} more than once")
        train, test, excluded = set(self.train), set(self.test), set(self.excluded)
        for a, b, left, right in (
            ("train", "test", train, test),
            ("train", "excluded", train, excluded),
            ("test", "excluded", test, excluded),
        ):
            if left & right:
                problems.append(f"{b}: overlaps {a} on {sorted(left & right)}")
        if train | excluded != set(self.train_candidates):
            problems.append(
                f"train_candidates: train ∪ excluded {sorted(train | excluded)} must equal train_candidates "
                f"{sorted(self.train_candidates)}"
            )
        if not self.train:
            problems.append("train: must name at least one task")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def for_split(self, split: Literal["train", "test", "all"]) -> list[int]:
        """Default task set of the search/rollout stages (MASS_SPEC §1): all = train candidates + test."""
        if split == "train":
            return list(self.train_candidates)
        if split == "test":
            return list(self.test)
        return list(self.train_candidates) + list(self.test)
