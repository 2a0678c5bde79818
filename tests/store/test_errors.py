"""Stores that do not answer, refuse, or cannot be written: one `StorageError` line each, password masked, bounded.

Each call runs in a worker thread with a generous bound, so a regression (a missing timeout) fails the test instead
of hanging the suite; nothing asserts how long a call took.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mass_ops.errors import EXIT_FAILURE, exit_code_for
from mass_ops.store import migrations
from mass_ops.store.artifact_backends import open_artifact_store
from mass_ops.store.artifacts import ArtifactUnavailableError
from mass_ops.store.errors import StorageError
from mass_ops.store.local_artifacts import LocalArtifactStore
from mass_ops.store.metadata import MetadataStore
from mass_ops.store.repository import MetadataRepository
from mass_ops.store.s3_artifacts import S3ArtifactStore
from tests.fixtures.postgres import admin_url
from tests.support.store import SilentServer

BOUND_S = 90  # a call that has not returned by then hangs: the point of these tests is that none does
PASSWORD = "s3cr3t-pw"


def _fails_with_storage_error(call: Callable[[], Any]) -> StorageError:
    """Run `call` (bounded), require a one-line StorageError (exit 1) without the password, and return it."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(call)
        error = future.exception(timeout=BOUND_S)
    assert isinstance(error, StorageError), f"expected StorageError, got {type(error).__name__}: {error}"
    message = str(error)
    assert "\n" not in message and message.strip() == message
    assert PASSWORD not in message
    assert exit_code_for(error) == EXIT_FAILURE
    return error


def _postgres_reachable() -> bool:
    try:
        MetadataStore(admin_url(), pool_size=1, max_overflow=0).ping()
    except StorageError:
        return False
    return True


# --- metadata store -------------------------------------------------------------------------------------------


def test_a_postgres_server_that_never_answers_fails_db_upgrade(silent_server: SilentServer, small_store_timeouts):
    url = f"postgresql://mass:{PASSWORD}@{silent_server.host}:{silent_server.port}/mass"

    error = _fails_with_storage_error(lambda: migrations.upgrade(url))

    assert "connect failed: metadata store" in str(error)
    assert f"mass:***@{silent_server.host}:{silent_server.port}/mass" in str(error)
    assert "timeout" in str(error).lower()


def test_a_wrong_postgres_port_is_one_line(small_store_timeouts):
    # Port 1 on the loopback: nothing listens, the connection is refused at once.
    url = f"postgresql://mass:{PASSWORD}@127.0.0.1:1/mass"
    error = _fails_with_storage_error(lambda: MetadataRepository.from_url(url).get_cycle("c1"))
    assert "refused" in str(error).lower()
    assert "127.0.0.1:1" in str(error)


def test_a_missing_postgres_database_is_one_line(small_store_timeouts):
    if not _postgres_reachable():
        pytest.skip("no Postgres server at the test admin URL")
    base = admin_url().rsplit("/", 1)[0]
    url = f"{base}/mass_no_such_database_here"
    error = _fails_with_storage_error(lambda: migrations.current(url))
    assert "mass_no_such_database_here" in str(error)
    assert "does not exist" in str(error)


def test_a_garbage_sqlite_file_is_one_line(tmp_path: Path):
    database = tmp_path / "metadata.db"
    database.write_bytes(b"this is not a database, just text that happens to be here\n" * 200)
    url = f"sqlite:///{database}"

    for call in (lambda: migrations.upgrade(url), lambda: MetadataRepository.from_url(url).get_cycle("c1")):
        error = _fails_with_storage_error(call)
        assert "metadata store sqlite:///" in str(error)
        assert "not a database" in str(error)


def test_an_sqlite_path_under_a_file_is_one_line(tmp_path: Path):
    (tmp_path / "plain-file").write_text("x")
    error = _fails_with_storage_error(lambda: MetadataStore(f"sqlite:///{tmp_path / 'plain-file' / 'm.db'}"))
    assert "metadata store" in str(error)


def test_sql_errors_keep_their_type(sqlite_url: str):
    # Only the store not answering becomes a StorageError: a query against a missing table is a bug, not an outage.
    import sqlalchemy as sa

    store = MetadataStore(sqlite_url)
    with pytest.raises(sa.exc.OperationalError, match="no_such_table"), store.read() as session:
        session.execute(sa.text("SELECT * FROM no_such_table"))


# --- artifact store -------------------------------------------------------------------------------------------


def test_an_s3_endpoint_that_never_answers_fails_reads_and_writes(
    silent_server: SilentServer, small_store_timeouts, fake_s3_environment, monkeypatch
):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", silent_server.http_url)
    store = open_artifact_store("s3://mass-artifacts/cycles")
    assert isinstance(store, S3ArtifactStore)

    for call in (
        lambda: store.get_bytes("c1/status.json"),
        lambda: store.put_bytes("c1/status.json", b"{}"),
        lambda: store.list("c1/"),
    ):
        error = _fails_with_storage_error(call)
        assert isinstance(error, ArtifactUnavailableError)
        assert "artifact store s3://mass-artifacts/cycles" in str(error)
        assert "timeout" in str(error).lower() or "timed out" in str(error).lower()


def test_an_s3_endpoint_on_a_wrong_port_is_one_line(small_store_timeouts, fake_s3_environment, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")
    store = open_artifact_store("s3://mass-artifacts")
    error = _fails_with_storage_error(lambda: store.get_bytes("k"))
    assert "S3 download failed: artifact store s3://mass-artifacts/k" in str(error)


def test_a_local_artifact_folder_that_cannot_exist_is_one_line(tmp_path: Path):
    # A path under a regular file cannot be created, even by root (chmod would not stop root).
    (tmp_path / "plain-file").write_text("x")
    error = _fails_with_storage_error(lambda: open_artifact_store(str(tmp_path / "plain-file" / "artifacts")))
    assert "artifact store file://" in str(error)
    assert "Not a directory" in str(error)


def test_a_local_artifact_folder_that_cannot_be_written_is_one_line(tmp_path: Path):
    store = LocalArtifactStore(tmp_path / "artifacts")
    store.put_bytes("kept.txt", b"before")
    # Make staging impossible for anyone, root included: the staging folder becomes a plain file.
    os.rmdir(store.root / ".partial")
    (store.root / ".partial").write_text("not a folder")

    for call in (
        lambda: store.put_bytes("new.txt", b"after"),
        lambda: store.put_json("new.json", {"a": 1}),
        lambda: store.put_dir("new-dir", tmp_path),
    ):
        error = _fails_with_storage_error(call)
        assert isinstance(error, ArtifactUnavailableError)
        assert f"artifact store {store.url}" in str(error)
    assert store.list() == ["kept.txt"]
    assert store.get_bytes("kept.txt") == b"before"
