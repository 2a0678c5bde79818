"""Models in the artifact store: folder + manifest written last, verified downloads, local folders used in place."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mass_ops.store.artifact_backends import open_artifact_store
from mass_ops.store.artifacts import ArtifactInfo, ArtifactIntegrityError, ArtifactStore
from mass_ops.store.local_artifacts import LocalArtifactStore
from mass_ops.store.model_folders import (
    MANIFEST_NAME,
    ModelManifest,
    ModelStoreError,
    fetch_model,
    folder_manifest,
    is_side_file,
    publish_model,
    read_manifest,
    resolve_model_location,
)


def make_model(folder: Path, *, seed: int = 0) -> Path:
    """A small model-shaped folder: config, tokenizer, two weight shards, a nested file."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "seed": seed}))
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "model-00001-of-00002.safetensors").write_bytes(bytes(range(256)) * (4 + seed))
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"\x07" * 1000)
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.txt").write_text(f"model {seed}\n")
    return folder


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_publish_then_fetch_round_trips_with_a_manifest_listing_every_file(
    artifact_store: ArtifactStore, tmp_path: Path
) -> None:
    source = make_model(tmp_path / "src")
    published = publish_model(artifact_store, "models/L1-bf16", source, metadata={"format": "bf16"})
    assert not published.reused
    assert published.uri == artifact_store.uri("models/L1-bf16")

    stored = artifact_store.get_json(f"models/L1-bf16/{MANIFEST_NAME}")
    names = [row["name"] for row in stored["files"]]
    assert names == sorted(tree(source)) and "extra/notes.txt" in names
    for row in stored["files"]:
        assert row["sha256"] == sha(source / row["name"]) and row["size"] == (source / row["name"]).stat().st_size
    assert stored["total_size"] == sum(len(data) for data in tree(source).values())
    assert stored["metadata"] == {"format": "bf16"}
    assert read_manifest(artifact_store, "models/L1-bf16") == ModelManifest.from_dict(stored, where="test")

    fetched = fetch_model(artifact_store, "models/L1-bf16", tmp_path / "dest")
    assert fetched == tmp_path / "dest"
    copy = tree(fetched)
    assert copy.pop(MANIFEST_NAME) == json.dumps(stored, sort_keys=True, separators=(",", ":")).encode()
    assert copy == tree(source)


def test_an_s3_uri_inside_the_store_is_the_same_model_as_its_key(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    publish_model(artifact_store, "models/m", make_model(tmp_path / "src"))
    uri = artifact_store.uri("models/m")
    where = resolve_model_location(artifact_store, uri)
    if uri.startswith("s3://"):
        assert where.store is artifact_store and where.prefix == "models/m"
        assert tree(fetch_model(artifact_store, uri, tmp_path / "dest")) == tree(
            fetch_model(artifact_store, "models/m", tmp_path / "dest2")
        )
    else:  # a file:// URI names a local folder: used in place
        assert where.path == Path(artifact_store.root) / "models/m"  # type: ignore[attr-defined]
        assert fetch_model(artifact_store, uri, tmp_path / "unused") == where.path
        assert not (tmp_path / "unused").exists()


def test_republishing_the_same_files_is_a_no_op_and_a_different_model_is_refused(
    artifact_store: ArtifactStore, tmp_path: Path
) -> None:
    first = publish_model(artifact_store, "models/m", make_model(tmp_path / "a", seed=0))
    before = artifact_store.info(f"models/m/{MANIFEST_NAME}")
    again = publish_model(artifact_store, "models/m", make_model(tmp_path / "b", seed=0), metadata={"other": 1})
    assert again.reused and again.manifest == first.manifest  # the stored manifest (and its metadata) is kept
    assert artifact_store.info(f"models/m/{MANIFEST_NAME}").sha256 == before.sha256

    with pytest.raises(ModelStoreError, match="already holds a different published model"):
        publish_model(artifact_store, "models/m", make_model(tmp_path / "c", seed=1))
    assert artifact_store.info(f"models/m/{MANIFEST_NAME}").sha256 == before.sha256
    assert tree(fetch_model(artifact_store, "models/m", tmp_path / "dest")) != {}
    assert (tmp_path / "dest" / "config.json").read_text() == (tmp_path / "a" / "config.json").read_text()


class RecordingStore(LocalArtifactStore):
    """A local store that remembers the order in which keys became visible."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.published: list[str] = []

    def _publish(self, key: str, staged: Path, sha256: str, size: int) -> ArtifactInfo:
        info = super()._publish(key, staged, sha256, size)
        self.published.append(key)
        return info


def test_the_manifest_is_published_last_and_an_unfinished_publish_is_no_model(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path / "store")
    source = make_model(tmp_path / "src")
    # An interrupted publish of another model left a stray file and one file of this model, but no manifest.
    store.put_bytes("models/m/stale.bin", b"left over")
    store.put_file("models/m/config.json", source / "config.json")
    assert read_manifest(store, "models/m") is None
    with pytest.raises(ModelStoreError, match="no model is published"):
        fetch_model(store, "models/m", tmp_path / "dest")

    store.published.clear()
    publish_model(store, "models/m", source)
    assert store.published[-1] == f"models/m/{MANIFEST_NAME}"
    # The file already uploaded with the right hash was not sent again; the stray one is gone.
    assert "models/m/config.json" not in store.published
    assert "models/m/stale.bin" not in store.list("models/m/")
    assert sorted(store.list("models/m/")) == sorted(f"models/m/{n}" for n in [*tree(source), MANIFEST_NAME])


def test_a_fetched_file_that_differs_from_the_manifest_is_refused(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    publish_model(store, "models/m", make_model(tmp_path / "src"))
    # Edited behind the store's back: the store's own record refuses the bytes first.
    (store.root / "models/m/tokenizer.json").write_text('{"version": "2.0"}')
    with pytest.raises(ArtifactIntegrityError, match="does not match its recorded SHA-256"):
        fetch_model(store, "models/m", tmp_path / "dest")
    assert not (tmp_path / "dest" / "tokenizer.json").exists()
    assert not (tmp_path / "dest" / MANIFEST_NAME).exists()
    # Without the store's records (a folder from another tool), the manifest still names the original bytes.
    shutil.rmtree(store.root / ".meta")
    with pytest.raises(ModelStoreError, match="does not match the manifest"):
        fetch_model(store, "models/m", tmp_path / "dest")
    assert not (tmp_path / "dest" / "tokenizer.json").exists()
    assert not (tmp_path / "dest" / MANIFEST_NAME).exists()


def test_include_fetches_side_files_only_and_a_later_full_fetch_completes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    source = make_model(tmp_path / "src")
    publish_model(store, "models/m", source)
    dest = fetch_model(store, "models/m", tmp_path / "dest", include=is_side_file)
    assert sorted(p.name for p in dest.iterdir() if p.is_file()) == ["config.json", MANIFEST_NAME, "tokenizer.json"]

    downloaded: list[str] = []
    original = LocalArtifactStore.get_file

    def counting(self: LocalArtifactStore, key: str, target: Any) -> ArtifactInfo:
        downloaded.append(key)
        return original(self, key, target)

    monkeypatch.setattr(LocalArtifactStore, "get_file", counting)
    fetch_model(store, "models/m", dest)
    assert sorted(downloaded) == [
        "models/m/model-00001-of-00002.safetensors",
        "models/m/model-00002-of-00002.safetensors",
    ]
    assert {k: v for k, v in tree(dest).items() if k != MANIFEST_NAME} == tree(source)

    # An interrupted fetch (files, no manifest) resumes: correct files are kept, nothing else is downloaded.
    (dest / MANIFEST_NAME).unlink()
    (dest / "model-00002-of-00002.safetensors").unlink()
    downloaded.clear()
    fetch_model(store, "models/m", dest)
    assert downloaded == ["models/m/model-00002-of-00002.safetensors"]


def test_fetch_refuses_a_destination_holding_another_model(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    publish_model(store, "models/m", make_model(tmp_path / "src"))
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "weights.bin").write_bytes(b"someone else's")
    with pytest.raises(ModelStoreError, match=r"holds files of something else \(weights.bin\)"):
        fetch_model(store, "models/m", dest)
    assert (dest / "weights.bin").read_bytes() == b"someone else's"


def test_local_folders_are_used_in_place_and_checked_against_their_manifest(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    folder = make_model(tmp_path / "models" / "L0-bf16")
    for location in (str(folder), folder.as_uri()):
        assert fetch_model(store, location, tmp_path / "never") == folder
    assert not (tmp_path / "never").exists()
    with pytest.raises(ModelStoreError, match="does not exist or is empty"):
        fetch_model(store, str(tmp_path / "missing"), tmp_path / "never")

    # Publishing to a local folder copies it atomically, with its manifest; a changed file is then noticed.
    target = tmp_path / "published"
    publish_model(store, str(target), folder)
    assert tree(target).keys() == {*tree(folder), MANIFEST_NAME}
    assert publish_model(store, target.as_uri(), folder).reused
    (target / "config.json").write_text("{}")
    with pytest.raises(ModelStoreError, match=r"config\.json is missing or differs"):
        fetch_model(store, str(target), tmp_path / "never")


def test_publishing_to_a_non_empty_local_folder_without_manifest_is_refused(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    target = tmp_path / "target"
    target.mkdir()
    (target / "mine.txt").write_text("keep me")
    with pytest.raises(ModelStoreError, match="is not empty and holds no manifest"):
        publish_model(store, str(target), make_model(tmp_path / "src"))
    assert sorted(p.name for p in target.iterdir()) == ["mine.txt"]


def test_a_folder_manifest_leaves_out_its_own_manifest_file(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    source = make_model(tmp_path / "src")
    publish_model(store, "models/m", source)
    fetched = fetch_model(store, "models/m", tmp_path / "dest")
    # Re-publishing a fetched folder (it carries manifest.json) is the same model.
    assert folder_manifest(fetched).files == folder_manifest(source).files
    assert publish_model(store, "models/m", fetched).reused


@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("", "empty"),
        ("models/../etc", "not a usable artifact key"),
        ("gs://bucket/model", "unsupported scheme 'gs'"),
        ("file://host/models/m", "must name a local path"),
    ],
)
def test_bad_locations_are_refused_with_the_reason(tmp_path: Path, location: str, message: str) -> None:
    store = open_artifact_store(str(tmp_path / "store"))
    with pytest.raises(ModelStoreError, match=message):
        resolve_model_location(store, location)


def test_a_malformed_manifest_is_reported_with_its_uri(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    store.put_json(f"models/m/{MANIFEST_NAME}", {"format": "mass-ops-model/1", "files": [{"name": "../x"}]})
    with pytest.raises(ModelStoreError, match=r"manifest.json: file entry #0"):
        read_manifest(store, "models/m")
