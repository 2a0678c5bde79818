"""`mass-ops tasks import` on hostile task folders: exit 2, one line per problem, nothing written anywhere.

Each case builds a folder under `tmp_path/case/`, runs the real command with `--dest tmp_path/case/out/x/dest`, and
checks that every problem is listed (one line each), that the destination was not created (or left empty), and that
no file anywhere under `tmp_path` changed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from mass_ops.tasks import MAX_TASK_FILE_BYTES, builtin_catalogue_dir
from tests.hardening.cli_run import run_cli

# The attack of issue #13: a format spec renders task 46 as '.', so this pattern is '../../planted/query46.txt'
# for task 46 while task 1 (the only id the old check rendered) gives a harmless-looking name.
CLIMBING_PATTERN = "{task_id:c}{task_id:c}/{task_id:c}{task_id:c}/planted/query{task_id}.txt"


def _builtin_copy(root: Path) -> Path:
    src = root / "src"
    shutil.copytree(builtin_catalogue_dir(), src)
    return src


def _edit_splits(src: Path, **changes: object) -> None:
    path = src / "splits.json"
    splits = json.loads(path.read_text(encoding="utf-8"))
    splits.update(changes)
    path.write_text(json.dumps(splits), encoding="utf-8")


def climbing_pattern(root: Path) -> Path:
    """One task, 46, whose bare prompt pattern climbs two levels out of the source (a valid prompt waits there)."""
    builtin = builtin_catalogue_dir()
    src = root / "a" / "src"
    (src / "initial").mkdir(parents=True)
    shutil.copyfile(builtin / "teacher_directive.txt", src / "teacher_directive.txt")
    shutil.copyfile(builtin / "initial" / "query51_ourTeam.txt", src / "initial" / "query46_ourTeam.txt")
    (root / "planted").mkdir()
    shutil.copyfile(builtin / "bare" / "query51.txt", root / "planted" / "query46.txt")
    splits = {
        "designated_train": [46],
        "test": [],
        "sft_train": [46],
        "excluded_from_teacher_collection": {},
        "domains": {"finance": [46]},
        "task_prompt_pattern": CLIMBING_PATTERN,
        "initial_workflow_pattern": "initial/query{task_id}_ourTeam.txt",
    }
    (src / "splits.json").write_text(json.dumps(splits), encoding="utf-8")
    return src


def format_spec_in_both_patterns(root: Path) -> Path:
    src = _builtin_copy(root)
    _edit_splits(
        src,
        task_prompt_pattern="bare/query{task_id:d}.txt",
        initial_workflow_pattern="initial/query{task_id!s}_ourTeam.txt",
    )
    return src


def symlinked_file(root: Path) -> Path:
    """bare/query51.txt is a link to a valid prompt outside the source."""
    src = _builtin_copy(root)
    outside = root / "outside.txt"
    shutil.copyfile(src / "bare" / "query51.txt", outside)
    (src / "bare" / "query51.txt").unlink()
    (src / "bare" / "query51.txt").symlink_to(outside)
    return src


def symlinked_folder(root: Path) -> Path:
    """initial/ is a link to a valid copy of the initial prompts outside the source."""
    src = _builtin_copy(root)
    outside = root / "outside-initial"
    shutil.move(src / "initial", outside)
    (src / "initial").symlink_to(outside, target_is_directory=True)
    return src


def oversized_file(root: Path) -> Path:
    """A valid bare prompt padded after its suffix to one byte over the default cap."""
    src = _builtin_copy(root)
    path = src / "bare" / "query53.txt"
    data = path.read_bytes()
    path.write_bytes(data + b"\n" + b"x" * (MAX_TASK_FILE_BYTES - len(data)))
    return src


def three_problems(root: Path) -> Path:
    """A symlinked prompt, an oversized prompt and a missing prompt: all three are reported."""
    src = symlinked_file(root)
    path = src / "bare" / "query53.txt"
    path.write_bytes(path.read_bytes() + b"\n" + b"x" * MAX_TASK_FILE_BYTES)
    (src / "initial" / "query305_ourTeam.txt").unlink()
    return src


def bad_source_and_taken_destination(root: Path) -> Path:
    """A problem with the source and one with the destination (not empty): both are reported."""
    src = symlinked_file(root)
    dest = root / "out" / "x" / "dest"
    dest.mkdir(parents=True)
    (dest / "keep.txt").write_text("someone else's file", encoding="utf-8")
    return src


@dataclass(frozen=True)
class Case:
    """A hostile folder and the fragments that must each appear on its own stderr line (one line per problem)."""

    name: str
    build: Callable[[Path], Path]
    problems: tuple[str, ...]


CASES = [
    Case("climbing-format-spec", climbing_pattern, ("may hold only the plain '{task_id}' placeholder",)),
    Case(
        "format-spec-in-both-patterns",
        format_spec_in_both_patterns,
        ("task_prompt_pattern 'bare/query{task_id:d}.txt' may hold only", "initial_workflow_pattern"),
    ),
    Case("symlinked-file", symlinked_file, ("bare/query51.txt: symbolic links are refused",)),
    Case("symlinked-folder", symlinked_folder, ("initial: symbolic links are refused",) * 12),
    Case("oversized-file", oversized_file, (f"bare/query53.txt: larger than the {MAX_TASK_FILE_BYTES}-byte limit",)),
    Case(
        "three-problems",
        three_problems,
        (
            "bare/query51.txt: symbolic links are refused",
            "bare/query53.txt: larger than the",
            "initial/query305_ourTeam.txt: missing file",
        ),
    ),
    Case(
        "source-and-destination",
        bad_source_and_taken_destination,
        ("bare/query51.txt: symbolic links are refused", "dest: destination exists and is not an empty directory"),
    ),
]


def _snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under `root` (links by target, files by content)."""
    entries: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            entries[key] = f"-> {path.readlink()}"
        elif path.is_file():
            entries[key] = path.read_bytes()
        else:
            entries[key] = "dir"
    return entries


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_hostile_folder_is_refused_with_every_problem_and_nothing_written(tmp_path: Path, case: Case) -> None:
    root = tmp_path / "case"
    root.mkdir()
    src = case.build(root)
    dest = root / "out" / "x" / "dest"
    dest_existed = dest.exists()
    before = _snapshot(tmp_path)

    result = run_cli("tasks", "import", str(src), "--dest", str(dest), cwd=tmp_path)

    assert result.returncode == 2, (result.returncode, result.stderr_lines[-5:])
    assert len(result.stderr_lines) == len(case.problems), result.stderr_lines
    unmatched = list(result.stderr_lines)
    for fragment in case.problems:
        line = next((line for line in unmatched if fragment in line), None)
        assert line is not None, (fragment, result.stderr_lines)
        unmatched.remove(line)
    assert _snapshot(tmp_path) == before, "the import wrote or changed files"
    assert dest.exists() == dest_existed


def test_the_climbing_pattern_renders_outside_with_str_format() -> None:
    """The attack is real: str.format would place task 46's prompt two levels above the folder."""
    assert CLIMBING_PATTERN.format(task_id=46) == "../../planted/query46.txt"
    assert ".." not in CLIMBING_PATTERN.format(task_id=1)
