"""Validation and atomic import of MASS-format task directories."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from mass_ops.tasks import (
    MAX_TASK_FILE_BYTES,
    TaskFormatError,
    TaskImportError,
    builtin_catalogue_dir,
    import_task_dir,
    importer,
    load_catalogue,
    validate_task_dir,
)
from mass_ops.workflow import END_MARKER, START_MARKER


@pytest.fixture
def task_dir(tmp_path: Path) -> Path:
    """A writable copy of the shipped catalogue."""
    copy = tmp_path / "src"
    shutil.copytree(builtin_catalogue_dir(), copy)
    return copy


def _edit_splits(root: Path, change: Callable[[dict], object]) -> None:
    path = root / "splits.json"
    splits = json.loads(path.read_text(encoding="utf-8"))
    change(splits)
    path.write_text(json.dumps(splits), encoding="utf-8")


def _edit_text(root: Path, relative: str, change: Callable[[str], str]) -> None:
    path = root / relative
    path.write_text(change(path.read_text(encoding="utf-8")), encoding="utf-8")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_shipped_catalogue_validates_and_imports(task_dir: Path, tmp_path: Path) -> None:
    (task_dir / "README.md").write_text("notes that are not part of the catalogue", encoding="utf-8")
    dest = tmp_path / "imported" / "tasks"
    catalogue = import_task_dir(task_dir, dest)
    assert catalogue.source == dest
    assert catalogue.ids == load_catalogue().ids
    imported = _files(dest)
    imported.pop("provenance.json")
    assert imported == _files(builtin_catalogue_dir())
    assert not (dest / "README.md").exists()
    assert load_catalogue(dest).tasks == load_catalogue().tasks
    assert sorted(p.name for p in dest.parent.iterdir()) == ["tasks"]


def test_import_into_an_empty_existing_directory(task_dir: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    import_task_dir(task_dir, dest)
    assert (dest / "splits.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "src"]


def test_import_refuses_a_non_empty_destination(task_dir: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_text("existing", encoding="utf-8")
    with pytest.raises(TaskImportError, match="destination exists and is not an empty directory") as info:
        import_task_dir(task_dir, dest)
    assert not isinstance(info.value, TaskFormatError)
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]


def test_a_failed_copy_leaves_nothing_behind(task_dir: Path, tmp_path: Path, monkeypatch) -> None:
    real_write = importer._write_new
    calls = []

    def flaky_write(path, data):
        calls.append(path)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return real_write(path, data)

    monkeypatch.setattr(importer, "_write_new", flaky_write)
    dest = tmp_path / "dest"
    with pytest.raises(OSError, match="No space left"):
        import_task_dir(task_dir, dest)
    assert not dest.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _set_key(key: str, value: object) -> Callable[[dict], object]:
    return lambda splits: splits.__setitem__(key, value)


# Each case: (id, how to break the directory, file the message must name, problem it must state).
MALFORMED: list[tuple[str, Callable[[Path], object], str, str]] = [
    ("no-splits", lambda r: (r / "splits.json").unlink(), "splits.json", "missing file"),
    (
        "splits-bad-json",
        lambda r: (r / "splits.json").write_text('{"test": [60,', "utf-8"),
        "splits.json",
        "invalid JSON",
    ),
    ("splits-not-object", lambda r: (r / "splits.json").write_text("[51, 60]", "utf-8"), "splits.json", "JSON object"),
    (
        "splits-missing-key",
        lambda r: _edit_splits(r, lambda s: s.pop("domains")),
        "splits.json",
        "missing key(s) domains",
    ),
    (
        "splits-overlap",
        lambda r: _edit_splits(r, lambda s: s["designated_train"].append(60)),
        "splits.json",
        "task(s) 60 are in both designated_train and test",
    ),
    (
        "sft-includes-excluded",
        lambda r: _edit_splits(r, lambda s: s["sft_train"].append(221)),
        "splits.json",
        "sft_train must equal designated_train minus excluded_from_teacher_collection (unexpected 221)",
    ),
    (
        "excluded-not-train",
        lambda r: _edit_splits(r, _set_key("excluded_from_teacher_collection", {"60": "why"})),
        "splits.json",
        "names task 60, which is not in designated_train",
    ),
    (
        "excluded-without-reason",
        lambda r: _edit_splits(r, _set_key("excluded_from_teacher_collection", {"221": " "})),
        "splits.json",
        "gives no reason for task 221",
    ),
    (
        "id-not-integer",
        lambda r: _edit_splits(r, lambda s: s["test"].__setitem__(0, "60")),
        "splits.json",
        "test holds '60', not a positive integer task id",
    ),
    (
        "duplicate-id",
        lambda r: _edit_splits(r, lambda s: s["test"].append(207)),
        "splits.json",
        "test lists task 207 twice",
    ),
    (
        "task-without-domain",
        lambda r: _edit_splits(r, lambda s: s["domains"]["robotics"].remove(324)),
        "splits.json",
        "task(s) 324 belong to no domain",
    ),
    (
        "task-in-two-domains",
        lambda r: _edit_splits(r, lambda s: s["domains"]["finance"].append(202)),
        "splits.json",
        "task 202 is in domains finance and pharmacy",
    ),
    (
        "pattern-escapes-directory",
        lambda r: _edit_splits(r, _set_key("task_prompt_pattern", "../bare/query{task_id}.txt")),
        "splits.json",
        "must be a relative path inside the task directory",
    ),
    (
        "pattern-without-placeholder",
        lambda r: _edit_splits(r, _set_key("initial_workflow_pattern", "initial/query_ourTeam.txt")),
        "splits.json",
        "must be a string containing '{task_id}'",
    ),
    (
        "id-without-files",
        lambda r: _edit_splits(r, lambda s: (s["test"].append(99), s["domains"]["finance"].append(99))),
        "bare/query99.txt",
        "missing file",
    ),
    ("missing-bare", lambda r: (r / "bare/query56.txt").unlink(), "bare/query56.txt", "missing file"),
    (
        "missing-initial",
        lambda r: (r / "initial/query305_ourTeam.txt").unlink(),
        "initial/query305_ourTeam.txt",
        "missing file",
    ),
    ("empty-bare", lambda r: (r / "bare/query53.txt").write_text(" \n", "utf-8"), "bare/query53.txt", "file is empty"),
    (
        "bare-not-utf8",
        lambda r: (r / "bare/query53.txt").write_bytes(b"caf\xe9 " + END_MARKER.encode()),
        "bare/query53.txt",
        "not UTF-8 text",
    ),
    (
        "bare-without-suffix",
        lambda r: _edit_text(r, "bare/query202.txt", lambda t: t[: t.index(END_MARKER)]),
        "bare/query202.txt",
        "lacks the suffix",
    ),
    (
        "bare-with-design",
        lambda r: _edit_text(
            r, "bare/query202.txt", lambda t: t.replace(END_MARKER, START_MARKER + " []\n" + END_MARKER)
        ),
        "bare/query202.txt",
        "contains a design block",
    ),
    (
        "bare-task-text-differs",
        lambda r: _edit_text(r, "bare/query60.txt", lambda t: t.replace("300 stocks", "400 stocks")),
        "initial/query60_ourTeam.txt",
        "task text differs from query60.txt",
    ),
    (
        "initial-without-start-marker",
        lambda r: _edit_text(r, "initial/query51_ourTeam.txt", lambda t: t.replace(START_MARKER, "Agents:")),
        "initial/query51_ourTeam.txt",
        "start marker",
    ),
    (
        "initial-without-end-marker",
        lambda r: _edit_text(r, "initial/query51_ourTeam.txt", lambda t: t.replace(END_MARKER, "Use pip")),
        "initial/query51_ourTeam.txt",
        "end marker",
    ),
    (
        "initial-agents-bad-json",
        lambda r: _edit_text(r, "initial/query207_ourTeam.txt", lambda t: t.replace('"role":', "'role':", 1)),
        "initial/query207_ourTeam.txt",
        "agent array is not valid JSON",
    ),
    (
        "initial-two-orchestrators",
        lambda r: _edit_text(
            r, "initial/query207_ourTeam.txt", lambda t: t.replace("agent_metrics_auditor", "agent_sub_orchestrator")
        ),
        "initial/query207_ourTeam.txt",
        "exactly one orchestrator agent required, found 2",
    ),
    (
        "initial-name-without-query-id",
        lambda r: (
            _edit_splits(r, _set_key("initial_workflow_pattern", "initial/team{task_id}.txt")),
            [
                p.rename(p.with_name(p.name.replace("query", "team").replace("_ourTeam", "")))
                for p in (r / "initial").iterdir()
            ],
        ),
        "initial/team51.txt",
        "file name must contain 'query51_ourTeam'",
    ),
    (
        "empty-directive",
        lambda r: (r / "teacher_directive.txt").write_text("\n\n", "utf-8"),
        "teacher_directive.txt",
        "file is empty",
    ),
    (
        "missing-directive",
        lambda r: (r / "teacher_directive.txt").unlink(),
        "teacher_directive.txt",
        "missing file",
    ),
    (
        "directive-is-directory",
        lambda r: ((r / "teacher_directive.txt").unlink(), (r / "teacher_directive.txt").mkdir()),
        "teacher_directive.txt",
        "not a regular file",
    ),
]


@pytest.mark.parametrize(
    ("breakage", "file", "problem"), [case[1:] for case in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_malformed_directories_are_rejected(
    task_dir: Path, tmp_path: Path, breakage: Callable[[Path], object], file: str, problem: str
) -> None:
    breakage(task_dir)
    with pytest.raises(TaskFormatError) as info:
        validate_task_dir(task_dir)
    problems = info.value.problems
    assert problems and all("\n" not in line for line in problems), problems
    assert str(info.value) == "\n".join(problems)
    named = [line for line in problems if line.startswith(str(task_dir / file) + ":")]
    assert any(problem in line for line in named), problems

    dest = tmp_path / "dest"
    with pytest.raises(TaskFormatError):
        import_task_dir(task_dir, dest)
    assert not dest.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_enough_distinct_malformations_are_covered() -> None:
    assert len({case[0] for case in MALFORMED}) == len(MALFORMED) >= 12
    assert len({case[2] for case in MALFORMED}) >= 8


def test_source_that_is_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(TaskFormatError, match="does not exist or is not a directory"):
        validate_task_dir(tmp_path / "absent")


def test_patterns_hold_only_the_plain_placeholder(task_dir: Path) -> None:
    for pattern in ("bare/query{task_id:c}.txt", "bare/{task_id}/{0}.txt", "bare/query{task_id}}.txt"):
        _edit_splits(task_dir, _set_key("task_prompt_pattern", pattern))
        with pytest.raises(TaskFormatError, match=re.escape("may hold only the plain '{task_id}' placeholder")):
            validate_task_dir(task_dir)


def test_rendering_is_plain_substitution_and_rendered_paths_are_checked() -> None:
    # Patterns hold no braces besides the placeholder, and every rendered path is checked anyway (defence in depth).
    assert importer.render_pattern("a/{task_id:c}", 46) == "a/{task_id:c}"
    assert importer.relative_path_problem("../x") and importer.relative_path_problem("a/./b")
    assert importer.relative_path_problem("bare/query51.txt") is None


def test_a_linked_file_or_folder_is_refused_even_inside_the_source(task_dir: Path) -> None:
    (task_dir / "bare" / "query51.txt").rename(task_dir / "elsewhere.txt")
    (task_dir / "bare" / "query51.txt").symlink_to(task_dir / "elsewhere.txt")
    (task_dir / "initial").rename(task_dir / "initial-real")
    (task_dir / "initial").symlink_to(task_dir / "initial-real", target_is_directory=True)
    with pytest.raises(TaskFormatError) as info:
        validate_task_dir(task_dir)
    links = [line for line in info.value.problems if "symbolic links are refused" in line]
    assert len(links) == 1 + 12 == len(info.value.problems), info.value.problems


def test_the_source_folder_itself_may_not_be_a_link(task_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(task_dir, target_is_directory=True)
    with pytest.raises(TaskFormatError, match="not a directory"):
        validate_task_dir(tmp_path / "link")


def test_file_size_cap_is_a_parameter_with_a_documented_default(task_dir: Path) -> None:
    assert MAX_TASK_FILE_BYTES == 1024 * 1024
    largest = max(p.stat().st_size for p in task_dir.rglob("*") if p.is_file())
    validate_task_dir(task_dir, max_file_bytes=largest)
    with pytest.raises(TaskFormatError) as info:
        validate_task_dir(task_dir, max_file_bytes=largest - 1)
    assert all(f"larger than the {largest - 1}-byte limit" in line for line in info.value.problems)


def test_every_problem_is_listed_before_anything_is_written(task_dir: Path, tmp_path: Path) -> None:
    (task_dir / "bare" / "query56.txt").unlink()
    (task_dir / "initial" / "query305_ourTeam.txt").write_text(" ", "utf-8")
    (task_dir / "teacher_directive.txt").write_bytes(b"\xff")
    _edit_splits(task_dir, _set_key("initial_workflow_pattern", "initial/{task_id!r}.txt"))
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine", "utf-8")
    with pytest.raises(TaskFormatError) as info:
        import_task_dir(task_dir, dest)
    problems = info.value.problems
    assert len(problems) == 3, problems  # splits.json stops the per-task reads: pattern, directive, destination
    assert any("initial_workflow_pattern" in line for line in problems)
    assert any("teacher_directive.txt: not UTF-8" in line for line in problems)
    assert any("destination exists" in line for line in problems)

    _edit_splits(task_dir, _set_key("initial_workflow_pattern", "initial/query{task_id}_ourTeam.txt"))
    with pytest.raises(TaskFormatError) as info:
        import_task_dir(task_dir, dest)
    assert len(info.value.problems) == 4, info.value.problems  # + missing bare prompt, empty initial prompt
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "src"]


def test_what_is_written_is_what_was_validated(task_dir: Path, tmp_path: Path, monkeypatch) -> None:
    # A source edited after validation (between reading and copying) cannot reach the destination.
    real_check = importer._check_dir

    def check_then_tamper(root, max_file_bytes):
        checked = real_check(root, max_file_bytes)
        if root == task_dir:
            (task_dir / "bare" / "query51.txt").write_text("tampered", "utf-8")
        return checked

    monkeypatch.setattr(importer, "_check_dir", check_then_tamper)
    expected = (builtin_catalogue_dir() / "bare" / "query51.txt").read_bytes()
    import_task_dir(task_dir, tmp_path / "dest")
    assert (tmp_path / "dest" / "bare" / "query51.txt").read_bytes() == expected
