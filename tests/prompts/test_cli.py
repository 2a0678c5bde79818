"""`mass-ops prompts list | show | export` and the validate commands with templates, through the real command."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from mass_ops.prompts import TEMPLATES, shipped_prompts
from mass_ops.prompts.library import TEMPLATE_DIR
from tests.hardening.cli_run import run_cli


def test_list_names_every_template_and_where_it_comes_from(tmp_path: Path) -> None:
    result = run_cli("prompts", "list", cwd=tmp_path)
    assert result.returncode == 0, result.stderr_lines
    for name, template in shipped_prompts().templates.items():
        assert name in result.stdout and template.sha256[:12] in result.stdout
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "optimizer_system.j2").write_text("Improve the design.\n", encoding="utf-8")
    result = run_cli("prompts", "list", "--set", f"prompts.dir={folder}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr_lines
    lines = result.stdout.splitlines()
    assert len(lines) == len(TEMPLATES)
    assert [line for line in lines if not line.endswith("[shipped]")] == [
        line
        for line in lines
        if line.startswith("optimizer_system.j2 ") and line.endswith(f"[{folder / 'optimizer_system.j2'}]")
    ]


def test_show_prints_the_source_and_refuses_an_unknown_name(tmp_path: Path) -> None:
    result = run_cli("prompts", "show", "judge_user.j2", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == (TEMPLATE_DIR / "judge_user.j2").read_text(encoding="utf-8")
    result = run_cli("prompts", "show", "judge.j2", cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr_lines) == 1
    assert result.stderr_lines[0].startswith(
        "prompts show: no template 'judge.j2'; templates: evidence.j2, judge_system.j2"
    )


def test_export_writes_every_template_once_and_never_overwrites(tmp_path: Path) -> None:
    dest = tmp_path / "exported" / "prompts"
    result = run_cli("prompts", "export", str(dest), cwd=tmp_path)
    assert result.returncode == 0, result.stderr_lines
    assert sorted(p.name for p in dest.iterdir()) == sorted(TEMPLATES)
    assert all((dest / n).read_bytes() == (TEMPLATE_DIR / n).read_bytes() for n in TEMPLATES)
    # The exported copies are a valid override folder as they are.
    result = run_cli("config", "validate", "--config", "demo", "--set", f"prompts.dir={dest}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr_lines

    other = tmp_path / "partly"
    other.mkdir()
    (other / "judge_user.j2").write_text("my own", encoding="utf-8")
    result = run_cli("prompts", "export", str(other), cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr_lines) == 1
    assert "judge_user.j2 already exist(s); nothing written" in result.stderr_lines[0]
    assert [p.name for p in other.iterdir()] == ["judge_user.j2"]
    assert (other / "judge_user.j2").read_text() == "my own"


def test_a_broken_template_fails_both_validate_commands_in_one_line_with_exit_2(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "judge_system.j2").write_text("You are {{ task_id }.\n", encoding="utf-8")
    database = tmp_path / "m.db"
    sets = [
        "--set", f"prompts.dir={folder}",
        "--set", f"storage.metadata_url=sqlite:///{database}",
        "--set", f"storage.artifact_url={tmp_path / 'artifacts'}",
    ]  # fmt: skip
    line = f"config: prompts: {folder / 'judge_system.j2'}: line 1: unexpected '}}'"
    result = run_cli("config", "validate", "--config", "demo", *sets, cwd=tmp_path)
    assert (result.returncode, result.stderr_lines) == (2, [line])
    result = run_cli("validate", "--config", "demo", *sets, cwd=tmp_path)
    assert (result.returncode, result.stderr_lines) == (2, [f"validate_config: {line}"])
    # The store probe that runs first may leave an empty SQLite file; no schema and no cycle row were written.
    if database.exists():
        with sqlite3.connect(database) as connection:
            assert connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall() == []


def test_an_unknown_template_file_fails_config_validate(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "judge_sytem.j2").write_text("typo", encoding="utf-8")
    result = run_cli("config", "validate", "--config", "demo", "--set", f"prompts.dir={folder}", cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr_lines) == 1
    assert "unknown template file(s) ['judge_sytem.j2']" in result.stderr_lines[0]


def test_a_template_that_escapes_to_os_system_fails_validate_in_one_line_with_exit_2(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    marker = tmp_path / "pwned"
    (folder / "judge_system.j2").write_text(
        f"{{{{ ''.__class__.__mro__[1] }}}}{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}",
        encoding="utf-8",
    )
    result = run_cli("config", "validate", "--config", "demo", "--set", f"prompts.dir={folder}", cwd=tmp_path)
    assert (result.returncode, len(result.stderr_lines)) == (2, 1), result.stderr_lines
    assert "judge_system.j2: line 1: accesses the unsafe attribute '__" in result.stderr_lines[0]
    assert not marker.exists() and "ok:" not in result.stdout
    sets = [
        "--set", f"prompts.dir={folder}",
        "--set", f"storage.metadata_url=sqlite:///{tmp_path / 'm.db'}",
        "--set", f"storage.artifact_url={tmp_path / 'artifacts'}",
    ]  # fmt: skip
    result = run_cli("validate", "--config", "demo", *sets, cwd=tmp_path)
    assert (result.returncode, len(result.stderr_lines)) == (2, 1), result.stderr_lines
    assert result.stderr_lines[0].startswith("validate_config: config: prompts: ") and not marker.exists()
