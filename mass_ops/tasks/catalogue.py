"""The task catalogue: research tasks, their prompts, splits and the teacher directive (MASS_SPEC §0).

A catalogue lives in a MASS-format directory (``bare/query<ID>.txt``, ``initial/query<ID>_ourTeam.txt``,
``splits.json``, ``teacher_directive.txt``). mass-ops ships its own 12 synthetic tasks in that format; other
directories are read through :func:`load_catalogue`, which validates them (see :mod:`mass_ops.tasks.importer`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mass_ops.workflow import Agent, WorkflowPrompt, bare_task_text, parse_agents, parse_prompt

Split = Literal["train", "test"]


class UnknownTaskError(ValueError):
    """A task id or split that the catalogue does not hold."""


@dataclass(frozen=True)
class Task:
    """One research task: its bare prompt (the reference condition) and its initial workflow prompt (v0)."""

    id: int
    domain: str
    split: Split
    excluded: bool
    bare_prompt: str
    initial_prompt: str
    exclusion_reason: str | None = None

    @property
    def name(self) -> str:
        """Query name used in paths and ranking rows, e.g. ``query51``."""
        return f"query{self.id}"

    @property
    def workflow_name(self) -> str:
        """Name of the workflow-search track, e.g. ``query51_ourTeam``."""
        return f"query{self.id}_ourTeam"

    @property
    def in_sft(self) -> bool:
        """Whether the task may contribute teacher trajectories (designated train and not excluded)."""
        return self.split == "train" and not self.excluded

    @property
    def task_text(self) -> str:
        """Task text for ranking and reporting (bare prompt before the uv suffix, escapes decoded)."""
        return bare_task_text(self.bare_prompt)

    @property
    def initial_workflow(self) -> WorkflowPrompt:
        """The initial prompt split around its design block (v0)."""
        return parse_prompt(self.initial_prompt, source=f"{self.workflow_name} (initial prompt)")

    @property
    def initial_agents(self) -> list[Agent]:
        return parse_agents(self.initial_workflow.design_block, source=f"{self.workflow_name} (initial design)")


@dataclass(frozen=True)
class TaskSplits:
    """The contents of ``splits.json`` (MASS_SPEC §0)."""

    designated_train: tuple[int, ...]
    test: tuple[int, ...]
    sft_train: tuple[int, ...]
    excluded: Mapping[int, str]
    domains: Mapping[str, tuple[int, ...]]
    task_prompt_pattern: str = "bare/query{task_id}.txt"
    initial_workflow_pattern: str = "initial/query{task_id}_ourTeam.txt"

    @property
    def all_ids(self) -> tuple[int, ...]:
        """Every task id, designated training tasks first, then test tasks."""
        return self.designated_train + self.test


@dataclass(frozen=True)
class TaskCatalogue:
    """Tasks by id, the splits they came with and the teacher directive (stripped)."""

    tasks: Mapping[int, Task]
    splits: TaskSplits
    teacher_directive: str
    source: Path | None = field(default=None, compare=False)

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks[task_id] for task_id in sorted(self.tasks))

    def __contains__(self, task_id: object) -> bool:
        return task_id in self.tasks

    def task(self, task_id: int) -> Task:
        """The task with ``task_id``; :class:`UnknownTaskError` when absent."""
        try:
            return self.tasks[task_id]
        except KeyError:
            known = ", ".join(str(i) for i in sorted(self.tasks))
            raise UnknownTaskError(f"unknown task id {task_id!r} (catalogue holds {known})") from None

    @property
    def ids(self) -> list[int]:
        return sorted(self.tasks)

    @property
    def designated_train_ids(self) -> list[int]:
        """Training candidates for workflow search (includes excluded tasks)."""
        return list(self.splits.designated_train)

    @property
    def test_ids(self) -> list[int]:
        return list(self.splits.test)

    @property
    def sft_train_ids(self) -> list[int]:
        """Tasks whose retained workflows feed teacher collection (designated train minus excluded)."""
        return list(self.splits.sft_train)

    @property
    def excluded_ids(self) -> list[int]:
        return sorted(self.splits.excluded)

    def ids_for(self, split: str) -> list[int]:
        """Ids of a split named as in ``splits.json`` (``designated_train``, ``sft_train``, ``test``) or ``all``."""
        if split == "designated_train":
            return self.designated_train_ids
        if split == "sft_train":
            return self.sft_train_ids
        if split == "test":
            return self.test_ids
        if split == "all":
            return list(self.splits.all_ids)
        raise UnknownTaskError(f"unknown split {split!r} (expected designated_train, sft_train, test or all)")

    def tasks_for(self, split: str) -> list[Task]:
        return [self.tasks[task_id] for task_id in self.ids_for(split)]

    def by_domain(self, domain: str) -> list[Task]:
        if domain not in self.splits.domains:
            known = ", ".join(sorted(self.splits.domains))
            raise UnknownTaskError(f"unknown domain {domain!r} (catalogue has {known})")
        return [self.tasks[task_id] for task_id in self.splits.domains[domain]]

    def teacher_prompt(self, retained_prompt: str) -> str:
        """Prompt for teacher collection: the retained workflow prompt followed by the teacher directive."""
        return retained_prompt.rstrip() + "\n\n" + self.teacher_directive


def builtin_catalogue_dir() -> Path:
    """Directory of the catalogue shipped with mass-ops (our 12 synthetic tasks)."""
    return Path(__file__).resolve().parent / "catalogue"


def load_catalogue(path: str | Path | None = None) -> TaskCatalogue:
    """Read and validate a MASS-format task directory; ``None`` loads the shipped catalogue.

    Raises :class:`mass_ops.tasks.importer.TaskFormatError` naming the file and the problem on malformed input.
    """
    # The importer builds Task/TaskCatalogue objects from this module, so it is imported here, not at the top.
    from mass_ops.tasks.importer import validate_task_dir

    return validate_task_dir(builtin_catalogue_dir() if path is None else Path(path))
