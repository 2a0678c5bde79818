"""probe_stores: both stores answer and the artifact store takes, returns and deletes a probe object."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mass_ops.store.artifact_backends import open_artifact_store
from mass_ops.store.artifacts import ArtifactStoreConfigError
from mass_ops.store.errors import StorageError
from mass_ops.store.probe import probe_artifact_store, probe_metadata_store, probe_stores
from tests.fixtures.s3 import MotoS3Server
from tests.support.store import SilentServer


def test_healthy_stores_pass_and_leave_nothing_behind(sqlite_url: str, local_artifact_url: str):
    assert probe_stores(sqlite_url, local_artifact_url) is None
    store = open_artifact_store(local_artifact_url)
    assert store.list() == []
    probes = Path(store.root) / ".probe"
    assert not probes.exists() or list(probes.iterdir()) == []


def test_healthy_s3_store_passes_and_leaves_only_its_marker(
    sqlite_url: str, s3_artifact_url: str, moto_s3_server: MotoS3Server
):
    probe_stores(sqlite_url, s3_artifact_url)
    bucket, prefix = s3_artifact_url.removeprefix("s3://").split("/", 1)
    listed = moto_s3_server.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    # The probe's own object is gone; the store's marker (what `store gc` requires) stays.
    assert [item["Key"] for item in listed.get("Contents", [])] == [f"{prefix}/.mass-ops-store"]


def test_an_unwritable_artifact_store_fails_the_probe(sqlite_url: str, tmp_path: Path):
    root = tmp_path / "artifacts"
    open_artifact_store(str(root))
    os.rmdir(root / ".partial")
    (root / ".partial").write_text("a file where the staging folder was")  # fails for root too
    with pytest.raises(StorageError, match=r"artifact store file://.*artifacts") as caught:
        probe_stores(sqlite_url, str(root))
    assert "\n" not in str(caught.value)


def test_a_silent_metadata_store_fails_the_probe_first(
    silent_server: SilentServer, small_store_timeouts, local_artifact_url: str
):
    url = f"postgresql://mass:pw@{silent_server.host}:{silent_server.port}/mass"
    with ThreadPoolExecutor(max_workers=1) as pool:
        error = pool.submit(probe_stores, url, local_artifact_url).exception(timeout=90)
    assert isinstance(error, StorageError)
    assert "metadata store" in str(error)
    assert "mass:***@" in str(error)


def test_a_silent_s3_endpoint_fails_the_probe(
    silent_server: SilentServer, small_store_timeouts, fake_s3_environment, monkeypatch
):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", silent_server.http_url)
    with ThreadPoolExecutor(max_workers=1) as pool:
        error = pool.submit(probe_artifact_store, "s3://mass-artifacts/x").exception(timeout=90)
    assert isinstance(error, StorageError)
    assert "artifact store s3://mass-artifacts/x/.probe/" in str(error)


def test_a_garbage_metadata_file_fails_the_probe(tmp_path: Path):
    (tmp_path / "m.db").write_bytes(os.urandom(4096))
    with pytest.raises(StorageError, match="not a database"):
        probe_metadata_store(f"sqlite:///{tmp_path / 'm.db'}")


def test_a_missing_bucket_is_a_config_error(sqlite_url: str, s3_environment: MotoS3Server):
    with pytest.raises(ArtifactStoreConfigError, match="does not exist"):
        probe_artifact_store("s3://no-such-bucket-probe/x")
