"""Commands against stores that fail: one line, the right exit status, no password on screen (#13.3, #13.5)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

MASS_OPS = str(Path(sys.executable).with_name("mass-ops"))
SECRET = "s3cr3t-pw"


def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    merged = {**os.environ, **(env or {})}
    return subprocess.run(
        [MASS_OPS, *args], capture_output=True, text=True, timeout=120, env=merged, cwd=cwd, check=False
    )


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP server on 127.0.0.1 that accepts and never answers (listening before the test starts)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    listener.close()


def storage_sets(tmp_path: Path, metadata_url: str | None = None, artifact_url: str | None = None) -> list[str]:
    meta = metadata_url or f"sqlite:///{tmp_path}/m.db"
    art = artifact_url or str(tmp_path / "artifacts")
    return ["--set", f"storage.metadata_url={meta}", "--set", f"storage.artifact_url={art}"]


@pytest.mark.parametrize("command", [["config", "show"], ["plan", "--show-config"], ["plan", "--json"]])
def test_printed_configs_mask_the_metadata_password(command: list[str], tmp_path: Path):
    url = f"postgresql://mass:{SECRET}@127.0.0.1:5432/mass"
    result = run(*command, "--config", "demo", env={"MASS_METADATA_URL": url})
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert "mass:***@127.0.0.1" in result.stdout


def test_validate_against_a_silent_database_fails_in_one_line(silent_port: int, tmp_path: Path):
    url = f"postgresql://mass:{SECRET}@127.0.0.1:{silent_port}/mass"
    started = time.monotonic()
    result = run(
        "validate", "--config", "demo", *storage_sets(tmp_path, metadata_url=url),
        env={"MASS_STORE_CONNECT_TIMEOUT_S": "2", "MASS_STORE_MAX_ATTEMPTS": "1"},
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "metadata" in lines[0] and f"127.0.0.1:{silent_port}" in lines[0], lines
    assert SECRET not in result.stdout + result.stderr
    assert time.monotonic() - started < 100  # it returned (the old code waited forever); not a speed goal


def test_validate_with_an_unwritable_artifact_store_fails_before_opening_the_cycle(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")  # a store root below a regular file cannot be created, even by root
    result = run("validate", "--config", "demo", *storage_sets(tmp_path, artifact_url=str(blocker / "artifacts")))
    assert result.returncode == 1, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "m.db").exists() or "cycles" not in (tmp_path / "m.db").read_bytes().decode("latin-1")


def test_store_gc_lists_by_default_and_removes_only_with_apply(tmp_path: Path):
    sets = storage_sets(tmp_path)
    assert run("validate", "--config", "demo", *sets).returncode == 0
    partial = tmp_path / "artifacts" / ".partial"
    partial.mkdir(parents=True, exist_ok=True)
    leftover = partial / "put-0123456789abcdef.partial"
    leftover.write_bytes(b"x" * 100)
    old = time.time() - 7200
    os.utime(leftover, (old, old))

    dry = run("store", "gc", "--config", "demo", *sets, "--grace-s", "3600")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.strip().splitlines()[-1].startswith("dry run: ") and leftover.exists()
    assert any(line.startswith("leftover\twould remove") for line in dry.stdout.splitlines())

    applied = run("store", "gc", "--config", "demo", *sets, "--grace-s", "3600", "--apply")
    assert applied.returncode == 0, applied.stderr
    assert not leftover.exists()

    refused = run("store", "gc", "--config", "demo", *sets, "--delete-unreferenced")
    assert refused.returncode == 2 and "--apply" in refused.stderr


def test_plan_json_is_still_json(tmp_path: Path):
    result = run("plan", "--config", "demo", "--json")
    assert json.loads(result.stdout)["config"]["storage"]["metadata_url"]


def test_store_gc_pointed_at_a_home_folder_deletes_nothing(tmp_path: Path):
    """The reported case: `store gc --apply --delete-unreferenced` with the artifact URL set to a home folder."""
    home = tmp_path / "home"
    key = home / ".ssh" / "id_rsa"
    key.parent.mkdir(parents=True)
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    old = time.time() - 3 * 86400
    os.utime(key, (old, old))
    sets = storage_sets(tmp_path, artifact_url=str(home))
    assert run("db", "upgrade", "--config", "demo", *sets).returncode == 0

    result = run("store", "gc", "--config", "demo", *sets, "--apply", "--delete-unreferenced", "--grace-s", "60")
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"store gc: {home.as_uri()} is not a mass-ops artifact store: it has no .mass-ops-store")
    assert key.read_text().startswith("-----BEGIN") and sorted(p.name for p in home.iterdir()) == [".ssh"]


def test_store_init_marks_a_store_an_older_mass_ops_wrote(tmp_path: Path):
    sets = storage_sets(tmp_path)
    assert run("db", "upgrade", "--config", "demo", *sets).returncode == 0
    artifacts = tmp_path / "artifacts"
    (artifacts / "cycles" / "old-L0").mkdir(parents=True)
    (artifacts / "cycles" / "old-L0" / "report.md").write_text("# an old report\n")
    assert run("store", "gc", "--config", "demo", *sets).returncode == 2, "no marker yet: refused"

    marked = run("store", "init", "--config", "demo", *sets)
    assert marked.returncode == 0, marked.stderr
    assert (
        marked.stdout.strip()
        == f"{artifacts.as_uri()}: marked as a mass-ops artifact store (.mass-ops-store); 1 artifacts"
    )
    assert "already marked" in run("store", "init", "--config", "demo", *sets).stdout
    listed = run("store", "gc", "--config", "demo", *sets)
    assert listed.returncode == 0, listed.stderr
    assert "unreferenced\tlisted\tcycles/old-L0/report.md" in listed.stdout.splitlines()


@pytest.mark.parametrize(
    "command",
    [["status", "demo-L0"], ["report"], ["repair", "demo-L0"], ["store", "gc"], ["search"]],
    ids=lambda c: " ".join(c),
)
def test_an_unmigrated_database_is_one_line_naming_db_upgrade(tmp_path: Path, command: list[str]):
    import sqlite3

    database = tmp_path / "m.db"
    sqlite3.connect(database).close()  # a database file that no migration has touched
    sets = storage_sets(tmp_path)
    assert run("store", "init", "--config", "demo", *sets).returncode == 0
    result = run(*command, "--config", "demo", *sets)
    assert result.returncode == 2, result.stdout + result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert f"metadata store sqlite:///{database} does not hold the mass-ops schema (no table " in line, line
    assert "run `mass-ops db upgrade` with the same --config/--set" in line
