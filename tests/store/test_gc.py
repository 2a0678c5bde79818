"""gc: staging leftovers removed only when old and only on apply; unreferenced artifacts listed, deleted on request;
and only ever in a location that carries the mass-ops store marker."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mass_ops.store import migrations
from mass_ops.store.artifact_backends import open_artifact_store
from mass_ops.store.artifacts import STORE_MARKER, ArtifactStore
from mass_ops.store.gc import GcSettingError, NotAMassOpsStoreError, gc, grace_from_env
from mass_ops.store.local_artifacts import LocalArtifactStore
from mass_ops.store.metadata import MetadataStore
from mass_ops.store.repository import MetadataRepository
from mass_ops.store.s3_artifacts import S3ArtifactStore
from tests.fixtures.s3 import MotoS3Server

HOUR = 3600.0


@pytest.fixture
def repository(sqlite_url: str) -> MetadataRepository:
    migrations.upgrade(sqlite_url)
    return MetadataRepository(MetadataStore(sqlite_url))


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_old_staging_leftovers_are_listed_then_removed_and_live_ones_kept(
    local_artifact_url: str, repository: MetadataRepository
):
    store = LocalArtifactStore(local_artifact_url.removeprefix("file://"))
    store.mark()  # what a run's first probe does
    store.put_bytes("cycles/c1/a.json", b"{}")
    partial = store.root / ".partial"
    old = [partial / "put-0123456789abcdef.partial", partial / "record-fedcba9876543210.partial"]
    for path in old:
        path.write_bytes(b"x" * 1000)
        _age(path, 2 * HOUR)
    live = partial / "put-aaaaaaaaaaaaaaaa.partial"
    live.write_bytes(b"being written")
    probe = store.root / ".probe"
    probe.mkdir()
    (probe / "stale").write_bytes(b"probe")
    _age(probe / "stale", 2 * HOUR)

    report = gc(store, repository, grace_s=HOUR)
    assert report.dry_run
    assert sorted(leftover.location for leftover in report.leftovers) == sorted([*map(str, old), str(probe / "stale")])
    assert all(path.exists() for path in old) and report.removed == []
    assert report.lines()[-1].startswith("dry run: ")

    report = gc(store, repository, dry_run=False, grace_s=HOUR)
    assert not any(path.exists() for path in old)
    assert not (probe / "stale").exists()
    assert live.exists()
    assert len(report.removed) == 3
    assert store.get_bytes("cycles/c1/a.json") == b"{}"


def test_orphan_records_of_deleted_keys_are_leftovers(local_artifact_url: str, repository: MetadataRepository):
    store = LocalArtifactStore(local_artifact_url.removeprefix("file://"))
    store.mark()
    store.put_bytes("gone.bin", b"data")
    (store.root / "gone.bin").unlink()  # removed by hand: its record folder is all that is left
    records = store._records_dir("gone.bin")
    for path in (*records.iterdir(), records):
        _age(path, 2 * HOUR)

    report = gc(store, repository, dry_run=False, grace_s=HOUR)
    assert [leftover.kind for leftover in report.leftovers] == ["orphan record"]
    assert not records.exists()


def _referenced_artifacts(store: ArtifactStore, repository: MetadataRepository) -> None:
    cycle = repository.ensure_cycle("c1", {}, "0" * 64)
    prompt = store.put_bytes("cycles/c1/calls/1/prompt.txt", b"prompt")
    repository.record_llm_call(
        cycle.id, "judge-1", purpose="judge", model="m", prompt_uri=prompt.uri, prompt_sha256=prompt.sha256
    )
    store.put_bytes("cycles/c1/datasets/train/shard-0.jsonl", b"{}\n")  # under a referenced prefix
    repository.record_dataset(
        cycle.id,
        "train",
        store.uri("cycles/c1/datasets/train"),
        episodes=1,
        windows=1,
        loss_tokens=1,
        total_tokens=1,
    )
    stream = store.put_bytes("cycles/c1/episodes/e1/stream.jsonl", b"{}\n")
    repository.record_episode(
        cycle.id,
        task_id="1",
        kind="collection",
        seed=1,
        status="succeeded",
        artifacts={"stream": stream.uri},
        artifact_sha256={"stream": stream.sha256},
    )


def test_unreferenced_artifacts_are_listed_and_deleted_only_on_request(
    artifact_store: ArtifactStore, repository: MetadataRepository
):
    artifact_store.mark()
    _referenced_artifacts(artifact_store, repository)
    artifact_store.put_bytes("cycles/c1/orphan.bin", b"nobody points here")

    report = gc(artifact_store, repository, grace_s=0.0)
    assert report.unreferenced == ["cycles/c1/orphan.bin"]
    assert report.referenced == 3

    gc(artifact_store, repository, dry_run=False, grace_s=0.0)  # apply alone never deletes artifacts
    assert artifact_store.exists("cycles/c1/orphan.bin")
    gc(artifact_store, repository, dry_run=True, delete_unreferenced=True, grace_s=0.0)  # nor does the flag alone
    assert artifact_store.exists("cycles/c1/orphan.bin")

    young = gc(artifact_store, repository, dry_run=False, delete_unreferenced=True, grace_s=HOUR)
    assert young.kept_young == ["cycles/c1/orphan.bin"] and young.deleted == []
    assert artifact_store.exists("cycles/c1/orphan.bin")

    report = gc(artifact_store, repository, dry_run=False, delete_unreferenced=True, grace_s=0.0)
    assert report.deleted == ["cycles/c1/orphan.bin"]
    assert artifact_store.list() == [
        "cycles/c1/calls/1/prompt.txt",
        "cycles/c1/datasets/train/shard-0.jsonl",
        "cycles/c1/episodes/e1/stream.jsonl",
    ]
    assert "unreferenced\tdeleted\tcycles/c1/orphan.bin" in report.lines()


def test_s3_unfinished_uploads_and_probe_objects_are_leftovers(
    s3_artifact_url: str, moto_s3_server: MotoS3Server, repository: MetadataRepository
):
    from mass_ops.store.artifact_backends import open_artifact_store

    store = open_artifact_store(s3_artifact_url)
    assert isinstance(store, S3ArtifactStore)
    client = moto_s3_server.client()
    client.create_multipart_upload(Bucket=store.bucket, Key=f"{store.prefix}/big.bin")
    client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/.probe/left-by-a-kill", Body=b"p")
    store.mark()

    # The probe object is younger than the grace period. (moto reports a fixed, years-old start for every
    # multipart upload, so the upload's age cannot be tested against it here.)
    assert "probe object" not in {leftover.kind for leftover in gc(store, repository, grace_s=HOUR).leftovers}
    report = gc(store, repository, dry_run=False, grace_s=0.0)
    assert sorted(leftover.kind for leftover in report.leftovers) == ["multipart upload", "probe object"]
    uploads = client.list_multipart_uploads(Bucket=store.bucket, Prefix=f"{store.prefix}/").get("Uploads", [])
    assert uploads == []
    left = client.list_objects_v2(Bucket=store.bucket, Prefix=f"{store.prefix}/").get("Contents", [])
    assert [item["Key"] for item in left] == [f"{store.prefix}/{STORE_MARKER}"], "only the store's marker is left"


def test_grace_period_setting(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("MASS_STORE_GC_GRACE_S", raising=False)
    assert grace_from_env() == 6 * HOUR
    monkeypatch.setenv("MASS_STORE_GC_GRACE_S", "7200")
    assert grace_from_env() == 7200
    for bad in ("5", "soon", "nan", "-1"):
        monkeypatch.setenv("MASS_STORE_GC_GRACE_S", bad)
        with pytest.raises(GcSettingError, match="MASS_STORE_GC_GRACE_S"):
            grace_from_env()


# -- only a mass-ops store is swept ----------------------------------------------------------------------------------


def _home_folder(root: Path) -> list[Path]:
    """A home folder as `store gc` might be pointed at by mistake: a key, a config, old enough to be 'garbage'."""
    files = [root / ".ssh" / "id_rsa", root / ".bashrc", root / "notes" / "plan.txt"]
    for path in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{path.name}\n")
        _age(path, 48 * HOUR)
    return files


def test_gc_refuses_a_folder_that_is_not_a_mass_ops_store(tmp_path: Path, repository: MetadataRepository):
    home = tmp_path / "home"
    files = _home_folder(home)
    store = open_artifact_store(str(home), create=False)
    for dry_run in (True, False):
        with pytest.raises(NotAMassOpsStoreError) as caught:
            gc(store, repository, dry_run=dry_run, delete_unreferenced=True, grace_s=0.0)
        assert str(caught.value).startswith(
            f"{home.as_uri()} is not a mass-ops artifact store: it has no {STORE_MARKER}"
        )
        assert "\n" not in str(caught.value)
    assert all(path.read_text() == f"{path.name}\n" for path in files)
    assert sorted(p.name for p in home.iterdir()) == [".bashrc", ".ssh", "notes"], "nothing was created there either"


def test_a_probe_marks_the_store_and_the_marker_is_never_an_artifact(
    artifact_store: ArtifactStore, repository: MetadataRepository
):
    assert not artifact_store.is_marked()
    with pytest.raises(NotAMassOpsStoreError):
        gc(artifact_store, repository, grace_s=0.0)
    artifact_store.probe()  # what validate and each cycle's first task run
    assert artifact_store.is_marked() and artifact_store.mark() is False
    assert STORE_MARKER not in artifact_store.list()
    report = gc(artifact_store, repository, dry_run=False, delete_unreferenced=True, grace_s=0.0)
    assert report.unreferenced == [] and artifact_store.is_marked()
    with pytest.raises(ValueError, match="reserved name"):
        artifact_store.put_bytes(STORE_MARKER, b"forged")  # a key cannot be the marker
