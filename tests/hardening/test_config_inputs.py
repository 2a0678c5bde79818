"""Hostile configs through the real CLI: each ends in exactly one line on stderr and exit status 2.

Config files go through `mass-ops validate --config FILE` (the stage that opens a cycle: a config that got through
would create a database in the test's folder); `--set` values through `mass-ops plan`, which must never allocate
more than a summary. Every run is fenced (2 GiB of address space, 60 s), so a regression fails here instead of
exhausting the machine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from mass_ops.config import (
    MAX_CANDIDATES,
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_TASKS,
    MAX_TRAINING_STEPS,
    preset_path,
)
from tests.hardening.cli_run import run_cli

DEMO_YAML = preset_path("demo").read_text(encoding="utf-8")


def alias_bomb() -> str:
    """0.5 KB of YAML that references expand into 9**9 (387 million) strings."""
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [{', '.join(['*' + previous] * 9)}]")
    return "\n".join(lines) + "\n"


def merge_alias() -> str:
    """An anchor and a merge key inside an otherwise valid preset (aliases are refused, not only big ones)."""
    return DEMO_YAML.replace("inference:", "x: &base {}\ninference:\n  <<: *base", 1)


@dataclass(frozen=True)
class FileCase:
    """A config file's name and bytes, and a fragment of the one line the command must print."""

    name: str
    filename: str
    content: Callable[[], bytes]
    fragment: str


FILE_CASES = [
    FileCase("alias-bomb", "bomb.yaml", lambda: alias_bomb().encode(), "YAML anchors (&a) are not allowed"),
    FileCase("merge-alias", "merge.yaml", lambda: merge_alias().encode(), "YAML anchors (&base) are not allowed"),
    FileCase(
        "deep-yaml-list",
        "deep.yaml",
        lambda: (DEMO_YAML + "x: " + "[" * 5000 + "]" * 5000 + "\n").encode(),
        f"nested deeper than {MAX_CONFIG_DEPTH} levels",
    ),
    FileCase(
        "deep-json-list",
        "deep.json",
        lambda: ('{"generation": 0, "x": ' + "[" * 5000 + "]" * 5000 + "}").encode(),
        f"nested deeper than {MAX_CONFIG_DEPTH} levels",
    ),
    FileCase(
        "not-utf8",
        "latin1.yaml",
        lambda: DEMO_YAML.replace("preset: demo", "name: caf\xe9").encode("latin-1"),
        "not UTF-8 text",
    ),
    FileCase(
        "duplicate-yaml-key",
        "dup.yaml",
        lambda: (DEMO_YAML + "generation: 7\n").encode(),
        "duplicate key 'generation'",
    ),
    FileCase(
        "duplicate-json-key",
        "dup.json",
        lambda: b'{"generation": 0, "preset": "demo", "generation": 1}',
        "duplicate key 'generation'",
    ),
    FileCase(
        "oversized-file",
        "huge.yaml",
        lambda: (DEMO_YAML + "# " + "x" * MAX_CONFIG_BYTES + "\n").encode(),
        f"larger than {MAX_CONFIG_BYTES} bytes",
    ),
    FileCase(
        "integer-with-5000-digits",
        "bigint.yaml",
        lambda: DEMO_YAML.replace("generation: 0", "generation: " + "9" * 5000).encode(),
        "Exceeds the limit",
    ),
]


@pytest.mark.parametrize("case", FILE_CASES, ids=[case.name for case in FILE_CASES])
def test_hostile_config_file_is_one_line_and_exit_2(tmp_path: Path, case: FileCase) -> None:
    path = tmp_path / case.filename
    path.write_bytes(case.content())
    result = run_cli("validate", "--config", str(path), cwd=tmp_path)
    assert result.returncode == 2, (result.returncode, result.stderr_lines[-5:])
    assert len(result.stderr_lines) == 1, result.stderr_lines
    assert case.fragment in result.stderr_lines[0], result.stderr_lines
    assert sorted(p.name for p in tmp_path.iterdir()) == [case.filename], "validate wrote files"


_TOO_MANY_TASKS = json.dumps(list(range(1, MAX_TASKS + 2)))

# (id, --set values for `plan --config demo`, fragment of the one line printed)
SET_CASES: list[tuple[str, list[str], str]] = [
    ("unknown-preset", ["preset=nonexistent"], "config: preset: Input should be 'paper', 'cycle2', 'demo' or"),
    ("name-with-newline", ['name="abc\\n"'], "config: name: must be 1-63 letters"),
    (
        "api-key-env-with-newline",
        ['inference.api_key_env="VLLM_API_KEY\\n"'],
        "inference.api_key_env: must be an environment variable name",
    ),
    ("training-steps-1e12", ["training.steps=1000000000000"], "config: training.steps:"),
    (
        "training-steps-over-max",
        [f"training.steps={MAX_TRAINING_STEPS + 1}"],
        f"exceeds the maximum of {MAX_TRAINING_STEPS}",
    ),
    ("candidates-1e30", ["collection.candidates=" + "1" + "0" * 30], f"less than or equal to {MAX_CANDIDATES}"),
    ("task-list-too-long", [f"tasks.train={_TOO_MANY_TASKS}"], f"at most {MAX_TASKS} items"),
    ("alias-in-value", ["tasks.train=&a [*a]"], "YAML anchors (&a) are not allowed"),
    ("deep-value", ["tasks.train=" + "[" * 5000 + "]" * 5000], f"nested deeper than {MAX_CONFIG_DEPTH} levels"),
    ("deep-key", [".".join(["a"] * 5000) + "=1"], f"key nested deeper than {MAX_CONFIG_DEPTH} levels"),
    ("duplicate-key-in-value", ["inference.sampling={top_k: 1, top_k: 2}"], "duplicate key 'top_k'"),
    ("integer-with-5000-digits", ["generation=" + "9" * 5000], "Exceeds the limit"),
]


@pytest.mark.parametrize(("overrides", "fragment"), [c[1:] for c in SET_CASES], ids=[c[0] for c in SET_CASES])
def test_hostile_override_is_one_line_and_exit_2(tmp_path: Path, overrides: list[str], fragment: str) -> None:
    args = [arg for value in overrides for arg in ("--set", value)]
    result = run_cli("plan", "--config", "demo", *args, cwd=tmp_path)
    assert result.returncode == 2, (result.returncode, result.stderr_lines[-5:])
    assert len(result.stderr_lines) == 1, result.stderr_lines
    assert fragment in result.stderr_lines[0], result.stderr_lines


def test_plan_at_every_maximum_still_succeeds(tmp_path: Path) -> None:
    """The bounds are reachable: a config at the documented maxima plans (as a summary)."""
    ids = json.dumps(list(range(1, MAX_TASKS + 1)))
    overrides = {
        "tasks.train": ids,
        "tasks.train_candidates": ids,
        "tasks.test": "[999999]",
        "tasks.excluded": "[]",
        "collection.candidates": str(MAX_CANDIDATES),
        "training.steps": str(MAX_TRAINING_STEPS),
        "training.val_every": "1",
        "training.save_every": "1",
    }
    args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    result = run_cli("plan", "--config", "demo", "--json", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr_lines[-5:]
    plan = json.loads(result.stdout)["plan"]
    collect = next(stage for stage in plan["stages"] if stage["stage"] == "collect")
    assert collect["counts"]["episodes"] == MAX_TASKS * MAX_CANDIDATES
