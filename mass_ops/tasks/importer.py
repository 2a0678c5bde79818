"""Read, validate, load and import a MASS-format task directory (the catalogue's model is `tasks.catalogue`).

Layout (MASS_SPEC §0): ``splits.json``, ``teacher_directive.txt`` and, per task, the files named by the split file's
``task_prompt_pattern`` (``bare/query{task_id}.txt``) and ``initial_workflow_pattern``
(``initial/query{task_id}_ourTeam.txt``). Every problem raises :class:`TaskFormatError` with one line naming the
file and what is wrong with it. Files in the directory that no task refers to are ignored and not imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from mass_ops import __version__
from mass_ops.errors import InputError
from mass_ops.store.untrusted import UntrustedInputError, loads_untrusted
from mass_ops.tasks.catalogue import CatalogueProvenance, Task, TaskCatalogue, TaskSplits, builtin_catalogue_dir
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
PROVENANCE_FILE = "provenance.json"
# Default cap on every file of a task directory. The largest shipped prompt is ~4 KB and the reference's are of the
# same order; a cap keeps a hostile or mistaken folder from filling the catalogue (and every episode) with megabytes.
MAX_TASK_FILE_BYTES = 1024 * 1024
PLACEHOLDER = "{task_id}"

_LIST_KEYS = ("designated_train", "test", "sft_train")
_PATTERN_KEYS = ("task_prompt_pattern", "initial_workflow_pattern")
_REQUIRED_KEYS = (*_LIST_KEYS, "excluded_from_teacher_collection", "domains", *_PATTERN_KEYS)
# Workflow search takes the query number from the prompt's file name (MASS_SPEC §3.1), so initial prompt file
# names must carry it.
_INITIAL_NAME_RE = re.compile(r"query(\d+)_ourTeam")


class TaskImportError(InputError):
    """A task directory cannot be imported; `problems` holds one line per problem, `str()` joins them."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class TaskFormatError(TaskImportError):
    """A task directory is malformed; each problem names the file and what is wrong with it."""


def render_pattern(pattern: str, task_id: int) -> str:
    """The file of `task_id` under a split-file pattern: plain substitution of `{task_id}`, never `str.format`
    (a format spec such as `{task_id:c}` would turn an id into any character, `.` and `/` included)."""
    return pattern.replace(PLACEHOLDER, str(task_id))


class _Reader:
    """Reads files of one task directory under the import rules and keeps the exact bytes it read.

    Every path must stay inside the directory once resolved, no component may be a symbolic link, and a file must
    be a regular file of at most `max_file_bytes`. The bytes kept are what an import writes, so what is copied is
    exactly what was validated (a source changed in between cannot slip through).
    """

    def __init__(self, root: Path, max_file_bytes: int) -> None:
        self.root = root
        self.resolved_root = root.resolve()
        self.max_file_bytes = max_file_bytes
        self.files: dict[str, bytes] = {}

    def text(self, relative: str) -> str:
        """Exact UTF-8 contents of a non-empty file (no newline translation: prompts are sent byte for byte)."""
        path = self.root / relative
        data = self._bytes(relative, path)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TaskFormatError(f"{path}: not UTF-8 text (invalid byte at offset {exc.start})") from exc
        if not text.strip():
            raise TaskFormatError(f"{path}: file is empty")
        self.files[relative] = data
        return text

    def exists(self, relative: str) -> bool:
        return os.path.lexists(self.root / relative)

    def _bytes(self, relative: str, path: Path) -> bytes:
        problem = relative_path_problem(relative)
        if problem:
            raise TaskFormatError(f"{path}: {problem}")
        current = self.root
        for part in PurePosixPath(relative).parts:
            current = current / part
            if current.is_symlink():
                raise TaskFormatError(f"{current}: symbolic links are refused (copy the file into the directory)")
        if not os.path.lexists(path):
            raise TaskFormatError(f"{path}: missing file")
        if not path.resolve().is_relative_to(self.resolved_root):
            raise TaskFormatError(f"{path}: resolves outside the task directory")
        if not stat.S_ISREG(path.lstat().st_mode):
            raise TaskFormatError(f"{path}: not a regular file")
        try:
            # O_NOFOLLOW: a file swapped for a link after the checks above is refused, not followed.
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as handle:
                data = handle.read(self.max_file_bytes + 1)
        except OSError as exc:
            raise TaskFormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
        if len(data) > self.max_file_bytes:
            raise TaskFormatError(f"{path}: larger than the {self.max_file_bytes}-byte limit per task file")
        return data


def relative_path_problem(relative: str) -> str | None:
    """Why `relative` is not a plain relative path inside a directory, or None when it is."""
    pure = PurePosixPath(relative)
    if (
        not relative
        or pure.is_absolute()
        or ".." in pure.parts
        or "\\" in relative
        or "\0" in relative
        or pure.parts[:1] == (".",)
        or relative != str(pure)
    ):
        return f"{relative!r} is not a relative path inside the task directory"
    return None


@dataclass(frozen=True)
class _Checked:
    """A validated directory: its catalogue and the exact bytes of every file it is made of."""

    catalogue: TaskCatalogue
    files: dict[str, bytes]


def validate_task_dir(path: str | Path, *, max_file_bytes: int = MAX_TASK_FILE_BYTES) -> TaskCatalogue:
    """Read the MASS-format directory at ``path`` and return its catalogue, or raise :class:`TaskFormatError`
    listing every problem found (one line each)."""
    return _check_dir(Path(path), max_file_bytes).catalogue


def load_catalogue(path: str | Path | None = None, *, max_file_bytes: int | None = None) -> TaskCatalogue:
    """Read and validate a MASS-format task directory; ``None`` loads the shipped catalogue.

    Raises :class:`TaskFormatError` listing every problem (file and what is wrong) on malformed input, including an
    imported directory whose files no longer match its ``provenance.json``. ``max_file_bytes`` caps every file
    (default :data:`MAX_TASK_FILE_BYTES`).
    """
    root = builtin_catalogue_dir() if path is None else Path(path)
    return validate_task_dir(root, max_file_bytes=max_file_bytes or MAX_TASK_FILE_BYTES)


def _check_dir(root: Path, max_file_bytes: int) -> _Checked:
    if root.is_symlink() or not root.is_dir():
        raise TaskFormatError(f"{root}: task directory does not exist or is not a directory")
    reader = _Reader(root, max_file_bytes)
    problems: list[str] = []
    splits: TaskSplits | None = None
    try:
        splits = _read_splits(reader)
    except TaskFormatError as exc:
        problems.extend(exc.problems)
    directive = ""
    try:
        directive = reader.text(DIRECTIVE_FILE).strip()
    except TaskFormatError as exc:
        problems.extend(exc.problems)
    tasks: dict[int, Task] = {}
    if splits is not None:
        for task_id in splits.all_ids:
            try:
                tasks[task_id] = _read_task(reader, task_id, splits)
            except TaskFormatError as exc:
                problems.extend(exc.problems)
    provenance = None
    if not problems and reader.exists(PROVENANCE_FILE):
        try:
            provenance = _read_provenance(reader)
        except TaskFormatError as exc:
            problems.extend(exc.problems)
    if problems:
        raise TaskFormatError(problems)
    assert splits is not None
    files = {name: data for name, data in reader.files.items() if name != PROVENANCE_FILE}
    catalogue = TaskCatalogue(
        tasks=tasks,
        splits=splits,
        teacher_directive=directive,
        source=root,
        file_sha256={name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())},
        provenance=provenance,
    )
    return _Checked(catalogue, files)


def import_task_dir(
    src: str | Path, dest: str | Path, *, max_file_bytes: int = MAX_TASK_FILE_BYTES, now: datetime | None = None
) -> TaskCatalogue:
    """Validate ``src`` and copy the files its catalogue uses to ``dest`` atomically, with a ``provenance.json``.

    ``dest`` must not exist or be an empty directory. Every problem with the source and the destination is
    reported at once (:class:`TaskImportError`, one line each) before anything is written. The bytes validated are
    the bytes written: they go into a temporary directory next to ``dest``, which is validated again and renamed
    into place; on any failure nothing is left at ``dest``. ``provenance.json`` records the source folder's name
    (not its path), the SHA-256 of every imported file, the import time (UTC) and the mass-ops version.
    """
    source = Path(src)
    target = Path(dest)
    problems: list[str] = []
    checked: _Checked | None = None
    try:
        checked = _check_dir(source, max_file_bytes)
    except TaskFormatError as exc:
        problems.extend(exc.problems)
    if target.is_symlink() or (target.exists() and (not target.is_dir() or any(target.iterdir()))):
        problems.append(f"{target}: destination exists and is not an empty directory")
    if checked is not None:
        resolved_target = target.resolve()
        for relative in checked.files:
            if not (resolved_target / relative).resolve().is_relative_to(resolved_target):
                problems.append(f"{target / relative}: would be written outside the destination")
    if problems:
        # Source problems are TaskFormatErrors; a destination problem alone is not a malformed source.
        only_destination = checked is not None
        raise (TaskImportError if only_destination else TaskFormatError)(problems)
    assert checked is not None

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.import-", dir=target.parent))
    try:
        resolved_staging = staging.resolve()
        for relative, data in checked.files.items():
            copy = staging / relative
            if not copy.resolve().is_relative_to(resolved_staging):
                raise TaskImportError(f"{target / relative}: would be written outside the destination")
            copy.parent.mkdir(parents=True, exist_ok=True)
            _write_new(copy, data)
        provenance = {
            "source": source.resolve().name,
            "files": checked.catalogue.file_sha256,
            "imported_at": (now or datetime.now(UTC)).astimezone(UTC).isoformat(timespec="seconds"),
            "mass_ops_version": __version__,
        }
        _write_new(staging / PROVENANCE_FILE, (json.dumps(provenance, indent=2, sort_keys=True) + "\n").encode())
        # Guards against a bug in the copy: the staged directory must read back as the same catalogue.
        copied = validate_task_dir(staging, max_file_bytes=max_file_bytes)
        if copied.file_sha256 != checked.catalogue.file_sha256:
            raise TaskImportError(f"{target}: the staged copy differs from the validated source")
        # mkdtemp creates the directory private to its owner; the imported catalogue is ordinary shared data.
        staging.chmod(0o755)
        if target.exists():
            target.rmdir()
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return validate_task_dir(target, max_file_bytes=max_file_bytes)


def _write_new(path: Path, data: bytes) -> None:
    """Write a file that must not exist yet (O_EXCL: never through a link or over another file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _read_provenance(reader: _Reader) -> CatalogueProvenance:
    """The import record of an imported directory, checked against the files as they are now."""
    path = reader.root / PROVENANCE_FILE
    raw = _json_file(reader, PROVENANCE_FILE)
    files = raw.get("files") if isinstance(raw, dict) else None
    fields = ("source", "imported_at", "mass_ops_version")
    if (
        not isinstance(files, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
        or not all(isinstance(raw.get(name), str) and raw.get(name) for name in fields)
    ):
        raise TaskFormatError(f"{path}: must hold source, files (name -> SHA-256), imported_at, mass_ops_version")
    current = {name: hashlib.sha256(data).hexdigest() for name, data in reader.files.items() if name != PROVENANCE_FILE}
    changed = sorted(name for name in current if files.get(name) != current[name])
    if changed or set(files) != set(current):
        what = ", ".join(changed) if changed else "the set of files"
        raise TaskFormatError(
            f"{path}: {what} changed since the import; import the source again rather than editing a catalogue"
        )
    return CatalogueProvenance(
        source=raw["source"],
        files=dict(sorted(files.items())),
        imported_at=raw["imported_at"],
        mass_ops_version=raw["mass_ops_version"],
    )


def _json_file(reader: _Reader, relative: str) -> Any:
    """A user-supplied JSON file of the directory, read by the platform's one reader of untrusted JSON (size, depth,
    encoding); TaskFormatError ``<path>: invalid JSON: <why>`` otherwise."""
    try:
        return loads_untrusted(reader.text(relative), what=f"{reader.root / relative}: invalid JSON")
    except UntrustedInputError as exc:
        raise TaskFormatError(str(exc)) from None


def _read_splits(reader: _Reader) -> TaskSplits:
    path = reader.root / SPLITS_FILE
    raw = _json_file(reader, SPLITS_FILE)
    if not isinstance(raw, dict):
        raise TaskFormatError(f"{path}: top level must be a JSON object, got {type(raw).__name__}")
    missing = [key for key in _REQUIRED_KEYS if key not in raw]
    if missing:
        raise TaskFormatError(f"{path}: missing key(s) {', '.join(missing)}")

    # Patterns are checked on their own so that a bad pattern is reported along with any split problem.
    problems: list[str] = []
    patterns: dict[str, str] = {}
    for key in _PATTERN_KEYS:
        try:
            patterns[key] = _pattern(path, key, raw[key])
        except TaskFormatError as exc:
            problems.extend(exc.problems)
    try:
        splits = _splits(path, raw)
    except TaskFormatError as exc:
        raise TaskFormatError([*problems, *exc.problems]) from None
    for key, pattern in patterns.items():
        for task_id in splits.all_ids:
            problem = relative_path_problem(render_pattern(pattern, task_id))
            if problem:
                problems.append(f"{path}: {key} renders task {task_id} as {problem}")
    if problems:
        raise TaskFormatError(problems)
    return replace(
        splits,
        task_prompt_pattern=patterns["task_prompt_pattern"],
        initial_workflow_pattern=patterns["initial_workflow_pattern"],
    )


def _splits(path: Path, raw: dict[str, Any]) -> TaskSplits:
    """The id lists, exclusions and domains of a split file (patterns left at their defaults)."""
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
    return TaskSplits(
        designated_train=tuple(designated),
        test=tuple(test),
        sft_train=tuple(sft),
        excluded=excluded,
        domains=domains,
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
    """A file-name pattern: a relative path holding the plain `{task_id}` placeholder and no other braces."""
    rest = value.replace(PLACEHOLDER, "") if isinstance(value, str) else ""
    if "{" in rest or "}" in rest:
        raise TaskFormatError(
            f"{path}: {key} {value!r} may hold only the plain '{{task_id}}' placeholder (no format spec, no other "
            "braces)"
        )
    if not isinstance(value, str) or PLACEHOLDER not in value:
        raise TaskFormatError(f"{path}: {key} must be a string containing '{{task_id}}', got {value!r}")
    if relative_path_problem(render_pattern(value, 1)):
        raise TaskFormatError(f"{path}: {key} {value!r} must be a relative path inside the task directory")
    return value


def _read_task(reader: _Reader, task_id: int, splits: TaskSplits) -> Task:
    """One task's bare and initial prompts; problems with both files are reported together."""
    bare_relative = render_pattern(splits.task_prompt_pattern, task_id)
    initial_relative = render_pattern(splits.initial_workflow_pattern, task_id)
    bare_path = reader.root / bare_relative
    initial_path = reader.root / initial_relative
    problems: list[str] = []
    bare = task_text = None
    try:
        bare = reader.text(bare_relative)
        if START_MARKER in bare:
            raise TaskFormatError(f"{bare_path}: bare prompt contains a design block (start marker found)")
        if END_MARKER not in bare:
            raise TaskFormatError(f"{bare_path}: bare prompt lacks the suffix starting {END_MARKER!r}")
        task_text = bare_task_text(bare)
        if not task_text:
            raise TaskFormatError(f"{bare_path}: bare prompt has no task text before the suffix")
    except TaskFormatError as exc:
        problems.extend(exc.problems)

    initial = workflow = None
    try:
        name_match = _INITIAL_NAME_RE.search(initial_path.name)
        if name_match is None or int(name_match.group(1)) != task_id:
            raise TaskFormatError(f"{initial_path}: file name must contain 'query{task_id}_ourTeam'")
        initial = reader.text(initial_relative)
        try:
            workflow = parse_prompt(initial, source=str(initial_path))
            parse_agents(workflow.design_block, source=str(initial_path))
        except WorkflowError as exc:
            raise TaskFormatError(str(exc)) from exc
    except TaskFormatError as exc:
        problems.extend(exc.problems)
    if problems:
        raise TaskFormatError(problems)
    assert bare is not None and task_text is not None and initial is not None and workflow is not None
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
