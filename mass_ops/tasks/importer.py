"""Read, validate and import a MASS-format task directory.

Layout (MASS_SPEC §0): ``splits.json``, ``teacher_directive.txt`` and, per task, the files named by the split file's
``task_prompt_pattern`` (``bare/query{task_id}.txt``) and ``initial_workflow_pattern``
(``initial/query{task_id}_ourTeam.txt``). Every problem raises :class:`TaskFormatError` with one line naming the
file and what is wrong with it. Files in the directory that no task refers to are ignored and not imported.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

from mass_ops.tasks.catalogue import Task, TaskCatalogue, TaskSplits
from mass_ops.workflow import (
    END_MARKER,
    START_MARKER,
    WorkflowError,
    bare_task_text,
    parse_agents,
    parse_prompt,
)

SPLITS_FILE = "splits.json"
DIRECTIVE_FILE = "teacher_directive.txt"

_LIST_KEYS = ("designated_train", "test", "sft_train")
_PATTERN_KEYS = ("task_prompt_pattern", "initial_workflow_pattern")
_REQUIRED_KEYS = (*_LIST_KEYS, "excluded_from_teacher_collection", "domains", *_PATTERN_KEYS)
# Workflow search takes the query number from the prompt's file name (MASS_SPEC §3.1), so initial prompt file
# names must carry it.
_INITIAL_NAME_RE = re.compile(r"query(\d+)_ourTeam")


class TaskImportError(ValueError):
    """A task directory cannot be imported."""


class TaskFormatError(TaskImportError):
    """A task directory is malformed; the message names the file and the problem."""


def validate_task_dir(path: str | Path) -> TaskCatalogue:
    """Read the MASS-format directory at ``path`` and return its catalogue, or raise :class:`TaskFormatError`."""
    root = Path(path)
    if not root.is_dir():
        raise TaskFormatError(f"{root}: task directory does not exist or is not a directory")
    splits = _read_splits(root / SPLITS_FILE)
    directive_path = root / DIRECTIVE_FILE
    directive = _read_text(directive_path).strip()
    if not directive:
        raise TaskFormatError(f"{directive_path}: teacher directive is empty")
    tasks = {task_id: _read_task(root, task_id, splits) for task_id in splits.all_ids}
    return TaskCatalogue(tasks=tasks, splits=splits, teacher_directive=directive, source=root)


def import_task_dir(src: str | Path, dest: str | Path) -> TaskCatalogue:
    """Validate ``src`` and copy the files its catalogue uses to ``dest`` atomically.

    ``dest`` must not exist or be an empty directory. The files are copied into a temporary directory next to
    ``dest``, validated again there, then renamed into place; on any failure nothing is left at ``dest``.
    """
    catalogue = validate_task_dir(src)
    source = Path(src)
    target = Path(dest)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise TaskImportError(f"{target}: destination exists and is not an empty directory")

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.import-", dir=target.parent))
    try:
        for relative in _catalogue_files(catalogue):
            copy = staging / relative
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / relative, copy)
        # Guards against a source that changed between validation and copying.
        validate_task_dir(staging)
        # mkdtemp creates the directory private to its owner; the imported catalogue is ordinary shared data.
        staging.chmod(0o755)
        if target.exists():
            target.rmdir()
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return replace(catalogue, source=target)


def _catalogue_files(catalogue: TaskCatalogue) -> list[str]:
    files = [SPLITS_FILE, DIRECTIVE_FILE]
    for task_id in catalogue.splits.all_ids:
        files.append(catalogue.splits.task_prompt_pattern.format(task_id=task_id))
        files.append(catalogue.splits.initial_workflow_pattern.format(task_id=task_id))
    return files


def _read_text(path: Path) -> str:
    """Exact UTF-8 contents of a non-empty file (no newline translation: prompts are sent byte for byte)."""
    if not path.exists():
        raise TaskFormatError(f"{path}: missing file")
    if not path.is_file():
        raise TaskFormatError(f"{path}: not a regular file")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise TaskFormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise TaskFormatError(f"{path}: not UTF-8 text (invalid byte at offset {exc.start})") from exc
    if not text.strip():
        raise TaskFormatError(f"{path}: file is empty")
    return text


def _read_splits(path: Path) -> TaskSplits:
    try:
        raw = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise TaskFormatError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
    if not isinstance(raw, dict):
        raise TaskFormatError(f"{path}: top level must be a JSON object, got {type(raw).__name__}")
    missing = [key for key in _REQUIRED_KEYS if key not in raw]
    if missing:
        raise TaskFormatError(f"{path}: missing key(s) {', '.join(missing)}")

    lists = {key: _id_list(path, key, raw[key]) for key in _LIST_KEYS}
    designated, test, sft = lists["designated_train"], lists["test"], lists["sft_train"]
    if not designated:
        raise TaskFormatError(f"{path}: designated_train is empty")
    overlap = sorted(set(designated) & set(test))
    if overlap:
        raise TaskFormatError(f"{path}: task(s) {_ids(overlap)} are in both designated_train and test")

    excluded = _excluded(path, raw["excluded_from_teacher_collection"], designated)
    expected_sft = [task_id for task_id in designated if task_id not in excluded]
    if set(sft) != set(expected_sft):
        extra = sorted(set(sft) - set(expected_sft))
        absent = sorted(set(expected_sft) - set(sft))
        details = "; ".join(
            part
            for part in (
                f"unexpected {_ids(extra)}" if extra else "",
                f"missing {_ids(absent)}" if absent else "",
            )
            if part
        )
        raise TaskFormatError(
            f"{path}: sft_train must equal designated_train minus excluded_from_teacher_collection ({details})"
        )

    domains = _domains(path, raw["domains"], designated + test)
    patterns = {key: _pattern(path, key, raw[key]) for key in _PATTERN_KEYS}
    return TaskSplits(
        designated_train=tuple(designated),
        test=tuple(test),
        sft_train=tuple(sft),
        excluded=excluded,
        domains=domains,
        task_prompt_pattern=patterns["task_prompt_pattern"],
        initial_workflow_pattern=patterns["initial_workflow_pattern"],
    )


def _ids(ids: list[int]) -> str:
    return ", ".join(str(task_id) for task_id in ids)


def _id_list(path: Path, key: str, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise TaskFormatError(f"{path}: {key} must be a list of task ids, got {type(value).__name__}")
    seen: set[int] = set()
    for item in value:
        # bool is an int subclass; true/false are never task ids.
        if isinstance(item, bool) or not isinstance(item, int) or item <= 0:
            raise TaskFormatError(f"{path}: {key} holds {item!r}, not a positive integer task id")
        if item in seen:
            raise TaskFormatError(f"{path}: {key} lists task {item} twice")
        seen.add(item)
    return list(value)


def _excluded(path: Path, value: Any, designated: list[int]) -> dict[int, str]:
    key = "excluded_from_teacher_collection"
    if not isinstance(value, dict):
        raise TaskFormatError(f"{path}: {key} must be an object mapping task id to reason, got {type(value).__name__}")
    excluded: dict[int, str] = {}
    for raw_id, reason in value.items():
        if not (isinstance(raw_id, str) and raw_id.isdecimal() and int(raw_id) > 0):
            raise TaskFormatError(f"{path}: {key} key {raw_id!r} is not a task id")
        task_id = int(raw_id)
        if task_id not in designated:
            raise TaskFormatError(f"{path}: {key} names task {task_id}, which is not in designated_train")
        if not isinstance(reason, str) or not reason.strip():
            raise TaskFormatError(f"{path}: {key} gives no reason for task {task_id}")
        excluded[task_id] = reason.strip()
    return excluded


def _domains(path: Path, value: Any, all_ids: list[int]) -> dict[str, tuple[int, ...]]:
    if not isinstance(value, dict) or not value:
        raise TaskFormatError(f"{path}: domains must be a non-empty object mapping domain names to task ids")
    owner: dict[int, str] = {}
    domains: dict[str, tuple[int, ...]] = {}
    for name, ids in value.items():
        if not name.strip():
            raise TaskFormatError(f"{path}: domains has an empty domain name")
        members = _id_list(path, f"domains.{name}", ids)
        for task_id in members:
            if task_id in owner:
                raise TaskFormatError(f"{path}: task {task_id} is in domains {owner[task_id]} and {name}")
            if task_id not in all_ids:
                raise TaskFormatError(f"{path}: domains.{name} lists task {task_id}, which is in no split")
            owner[task_id] = name
        domains[name] = tuple(members)
    homeless = [task_id for task_id in all_ids if task_id not in owner]
    if homeless:
        raise TaskFormatError(f"{path}: task(s) {_ids(homeless)} belong to no domain")
    return domains


def _pattern(path: Path, key: str, value: Any) -> str:
    if not isinstance(value, str) or "{task_id}" not in value:
        raise TaskFormatError(f"{path}: {key} must be a string containing '{{task_id}}', got {value!r}")
    try:
        example = value.format(task_id=1)
    except (KeyError, IndexError, ValueError) as exc:
        raise TaskFormatError(f"{path}: {key} {value!r} is not a valid file-name pattern ({exc})") from exc
    relative = PurePosixPath(example)
    if relative.is_absolute() or ".." in relative.parts or "\\" in example:
        raise TaskFormatError(f"{path}: {key} {value!r} must be a relative path inside the task directory")
    return value


def _read_task(root: Path, task_id: int, splits: TaskSplits) -> Task:
    bare_path = root / splits.task_prompt_pattern.format(task_id=task_id)
    initial_path = root / splits.initial_workflow_pattern.format(task_id=task_id)

    bare = _read_text(bare_path)
    if START_MARKER in bare:
        raise TaskFormatError(f"{bare_path}: bare prompt contains a design block (start marker found)")
    if END_MARKER not in bare:
        raise TaskFormatError(f"{bare_path}: bare prompt lacks the suffix starting {END_MARKER!r}")
    task_text = bare_task_text(bare)
    if not task_text:
        raise TaskFormatError(f"{bare_path}: bare prompt has no task text before the suffix")

    name_match = _INITIAL_NAME_RE.search(initial_path.name)
    if name_match is None or int(name_match.group(1)) != task_id:
        raise TaskFormatError(f"{initial_path}: file name must contain 'query{task_id}_ourTeam'")
    initial = _read_text(initial_path)
    try:
        workflow = parse_prompt(initial, source=str(initial_path))
        parse_agents(workflow.design_block, source=str(initial_path))
    except WorkflowError as exc:
        raise TaskFormatError(str(exc)) from exc
    if workflow.task_text != task_text:
        at = _first_difference(workflow.task_text, task_text)
        raise TaskFormatError(
            f"{initial_path}: task text differs from {bare_path.name} at character {at} "
            "(the initial prompt must repeat the bare task text before its design block)"
        )

    return Task(
        id=task_id,
        domain=next(name for name, ids in splits.domains.items() if task_id in ids),
        split="train" if task_id in splits.designated_train else "test",
        excluded=task_id in splits.excluded,
        bare_prompt=bare,
        initial_prompt=initial,
        exclusion_reason=splits.excluded.get(task_id),
    )


def _first_difference(left: str, right: str) -> int:
    for index, (a, b) in enumerate(zip(left, right, strict=False)):
        if a != b:
            return index
    return min(len(left), len(right))
