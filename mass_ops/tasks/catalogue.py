"""The task catalogue: research tasks, their prompts, splits and the teacher directive (MASS_SPEC §0).

A catalogue lives in a MASS-format directory (``bare/query<ID>.txt``, ``initial/query<ID>_ourTeam.txt``,
``splits.json``, ``teacher_directive.txt``). mass-ops ships its own 12 synthetic tasks in that format; other
directories are read through `mass_ops.tasks.importer.load_catalogue` (also `mass_ops.tasks.load_catalogue`), which
validates them. This module is the model only: it imports nothing from the importer.

Which catalogue a cycle used is :meth:`TaskCatalogue.identity`: ``builtin``, ``imported:<source>@<digest>`` for a
directory written by ``mass-ops tasks import`` (its ``provenance.json`` is checked against the files on every load),
or ``unimported:<folder>@<digest>`` for any other directory; the digest covers every file the catalogue is made of.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mass_ops.errors import InputError
from mass_ops.workflow import Agent, WorkflowPrompt, bare_task_text, parse_agents, parse_prompt

Split = Literal["train", "test"]
# Hex digits of the catalogue digest shown in an identity: enough to tell catalogues apart at a glance.
IDENTITY_DIGEST_CHARS = 12


class UnknownTaskError(InputError):
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
class CatalogueProvenance:
    """Where an imported catalogue came from (its ``provenance.json``): the source folder's name (never its full
    path), the SHA-256 of every imported file, the import time (UTC, ISO 8601) and the mass-ops version."""

    source: str
    files: Mapping[str, str]
    imported_at: str
    mass_ops_version: str

    def as_dict(self) -> dict[str, object]:
        """Plain data for a cycle row or a report."""
        return {
            "source": self.source,
            "files": dict(self.files),
            "imported_at": self.imported_at,
            "mass_ops_version": self.mass_ops_version,
        }


@dataclass(frozen=True)
class TaskCatalogue:
    """Tasks by id, the splits they came with and the teacher directive (stripped).

    ``file_sha256`` maps every file the catalogue was read from (relative path) to its SHA-256; ``provenance`` is
    the import record of a directory written by ``mass-ops tasks import`` (None otherwise).
    """

    tasks: Mapping[int, Task]
    splits: TaskSplits
    teacher_directive: str
    source: Path | None = field(default=None, compare=False)
    file_sha256: Mapping[str, str] = field(default_factory=dict, compare=False)
    provenance: CatalogueProvenance | None = field(default=None, compare=False)

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

    @property
    def digest(self) -> str:
        """SHA-256 over the sorted (file, SHA-256) pairs of the catalogue's files: equal digests, equal catalogues."""
        lines = "".join(f"{name}\t{sha}\n" for name, sha in sorted(self.file_sha256.items()))
        return hashlib.sha256(lines.encode()).hexdigest()

    def identity(self) -> str:
        """A short name of this catalogue for a cycle row and a report: ``builtin``,
        ``imported:<source folder>@<digest prefix>`` or ``unimported:<folder>@<digest prefix>``."""
        if self.source is not None and self.source.resolve() == builtin_catalogue_dir():
            return "builtin"
        short = self.digest[:IDENTITY_DIGEST_CHARS]
        if self.provenance is not None:
            return f"imported:{self.provenance.source}@{short}"
        folder = self.source.resolve().name if self.source is not None else "unknown"
        return f"unimported:{folder}@{short}"


def builtin_catalogue_dir() -> Path:
    """Directory of the catalogue shipped with mass-ops (our 12 synthetic tasks)."""
    return Path(__file__).resolve().parent / "catalogue"
