"""CLI commands outside the stages: config, db, tasks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from mass_ops.cli import app
from mass_ops.store.migrations import current
from mass_ops.tasks.catalogue import builtin_catalogue_dir

runner = CliRunner()


def test_config_schema_is_json_schema():
    result = runner.invoke(app, ["config", "schema"])
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert "training" in schema["properties"]


def test_config_validate_names_cycle_and_hash():
    result = runner.invoke(app, ["config", "validate", "--config", "cycle2", "--set", "tasks.catalogue=builtin"])
    assert result.exit_code == 0, result.output
    assert "cycle2-L1" in result.stdout


def test_unknown_preset_is_one_line_exit_2():
    result = runner.invoke(app, ["config", "show", "--config", "nonsense"])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0
    assert "no such preset or file" in result.stderr


def test_db_upgrade_and_downgrade_on_sqlite(tmp_path):
    url = f"sqlite:///{tmp_path}/m.db"
    assert runner.invoke(app, ["db", "upgrade", "--url", url]).exit_code == 0
    assert current(url) is not None
    assert runner.invoke(app, ["db", "downgrade", "base", "--url", url]).exit_code == 0
    assert current(url) is None


def test_db_upgrade_and_downgrade_report_where_the_schema_stands_or_fail_in_one_line(tmp_path):
    # One line however long the URL (longer than the 80 columns CliRunner gives rich): a newline inside it would
    # break copying it.
    url = f"sqlite:///{tmp_path}/{'m' * 80}.db"
    upgraded = runner.invoke(app, ["db", "upgrade", "--url", url]).stdout
    assert upgraded == f"{url} at revision {current(url)}\n"
    downgraded = runner.invoke(app, ["db", "downgrade", "base", "--url", url]).stdout
    assert downgraded == f"{url} at revision None\n"

    unopenable = f"sqlite:///{tmp_path}"  # a folder, not a database file
    for command in (["upgrade"], ["downgrade", "base"]):
        result = runner.invoke(app, ["db", *command, "--url", unopenable])
        assert result.exit_code == 1
        assert result.stderr.startswith(f"db {command[0]} failed: ")
        assert result.stderr.rstrip().endswith("fix the store and run it again")
        assert result.stderr.strip().count("\n") == 0


def test_tasks_import_copies_a_valid_directory_and_refuses_a_broken_one(tmp_path):
    dest = tmp_path / "imported"
    result = runner.invoke(app, ["tasks", "import", str(builtin_catalogue_dir()), "--dest", str(dest)])
    assert result.exit_code == 0, result.output
    assert (dest / "splits.json").is_file()

    broken = tmp_path / "broken"
    shutil.copytree(builtin_catalogue_dir(), broken)
    (broken / "splits.json").write_text("{not json")
    result = runner.invoke(app, ["tasks", "import", str(broken), "--dest", str(tmp_path / "never")])
    assert result.exit_code == 2
    assert "splits.json" in result.stderr
    assert not (tmp_path / "never").exists()


def test_tasks_list_shows_the_twelve_tasks():
    result = runner.invoke(app, ["tasks", "list"])
    assert result.exit_code == 0
    for task_id in (51, 53, 56, 60, 202, 205, 207, 221, 302, 305, 307, 324):
        assert str(task_id) in result.stdout


def test_stage_command_refuses_an_unknown_stage():
    result = runner.invoke(app, ["stage", "nonsense", "--config", "demo"])
    assert result.exit_code == 2
    assert "unknown" in result.stderr


def test_stage_command_runs_validate_config_and_prints_json(tmp_path):
    db = f"sqlite:///{tmp_path}/m.db"
    result = runner.invoke(
        app,
        [
            "stage",
            "validate_config",
            "--config",
            "demo",
            "--set",
            f"storage.metadata_url={db}",
            "--set",
            f"storage.artifact_url={tmp_path}/artifacts",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["cycle"] == "demo-L0"


def test_validate_paper_without_a_chosen_catalogue_is_one_line_naming_the_import(tmp_path):
    """The paper presets need the user's choice of tasks (the reference's texts cannot ship with mass-ops)."""
    storage = [f"storage.metadata_url=sqlite:///{tmp_path}/m.db", f"storage.artifact_url={tmp_path}/a"]
    sets = [x for s in storage for x in ("--set", s)]
    for command in (["validate"], ["config", "validate"]):
        result = CliRunner().invoke(app, [*command, "--config", "paper", *sets])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "mass-ops tasks import" in lines[0] and "tasks.catalogue=builtin" in lines[0]
    assert not (tmp_path / "m.db").exists()  # refused before the metadata store was touched


def run_cli(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """The real `mass-ops` in a child process, stdout a pipe (not a terminal), 80 columns."""
    environ = {k: v for k, v in os.environ.items() if k not in ("MASS_METADATA_URL", "MASS_ARTIFACT_URL")}
    environ.update(COLUMNS="80", **env)
    command = [sys.executable, "-c", "from mass_ops.cli import main; main()", *args]
    return subprocess.run(command, cwd=cwd, env=environ, capture_output=True, text=True, timeout=300)


def long_lines(text: str) -> list[str]:
    """Lines over 80 columns that are more than one word: only a lone path, URL or pattern may be longer."""
    return [line for line in text.splitlines() if len(line) > 80 and len(line.removesuffix(" \\").split()) > 1]


def test_plan_through_a_pipe_fits_80_columns_and_shows_the_config_only_when_asked():
    plan = run_cli("plan", "--config", "paper")
    assert plan.returncode == 0, plan.stderr
    assert long_lines(plan.stdout) == [], plan.stdout
    assert '"name": null' not in plan.stdout and len(plan.stdout.splitlines()) < 90
    assert "± one standard deviation" not in plan.stdout, "the paper's estimate carries no spread"
    assert "  python -m torch.distributed.run" in plan.stdout
    shown = run_cli("plan", "--config", "paper", "--show-config")
    assert '"name": null' in shown.stdout


def test_help_texts_hold_no_issue_numbers():
    import re

    for command in ([], ["benchmark"], ["plan"], ["status"], ["repair"], ["demo"], ["episode"], ["store"]):
        shown = runner.invoke(app, [*command, "--help"])
        assert shown.exit_code == 0, shown.output
        assert not re.search(r"#\d|ISSUE", shown.output), shown.output


def test_demo_outside_a_clone_without_dag_files_says_in_one_line_what_to_set(tmp_path: Path):
    empty = tmp_path / "no-dags"
    empty.mkdir()
    done = run_cli("demo", cwd=tmp_path, MASS_DAGS_DIR=str(empty))
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "MASS_DAGS_DIR" in line and "internal error" not in line
    assert not (tmp_path / "runs").exists(), "nothing written before the demo can run"


def test_demo_outside_a_clone_finds_the_dag_files_of_the_clone_it_is_installed_from(tmp_path, monkeypatch):
    from mass_ops_airflow.demo import airflow_home

    monkeypatch.chdir(tmp_path)
    assert airflow_home.dags_folder({}) == Path(__file__).resolve().parents[1] / "dags"
    assert airflow_home.dags_folder({"MASS_DAGS_DIR": str(tmp_path)}) == tmp_path.resolve()
