"""Artifact store behaviour on both backends: a local folder and S3 (moto's standalone server over HTTP)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import tarfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mass_ops.errors import InfrastructureError
from mass_ops.store.artifact_backends import open_artifact_store
from mass_ops.store.artifacts import (
    ArtifactError,
    ArtifactFormatError,
    ArtifactInfo,
    ArtifactIntegrityError,
    ArtifactKeyError,
    ArtifactNotFoundError,
    ArtifactSourceError,
    ArtifactStore,
    ArtifactStoreConfigError,
    UnsafeArchiveError,
)
from mass_ops.store.local_artifacts import LocalArtifactStore
from mass_ops.store.s3_artifacts import S3ArtifactStore
from tests.fixtures.s3 import MotoS3Server

MiB = 1024 * 1024


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _random_bytes(size: int, seed: int = 0) -> bytes:
    # Deterministic and incompressible enough; os.urandom would make failures harder to reproduce.
    blocks = []
    block = hashlib.sha256(str(seed).encode()).digest()
    while len(blocks) * 32 < size:
        block = hashlib.sha256(block).digest()
        blocks.append(block)
    return b"".join(blocks)[:size]


@dataclass
class Backend:
    """Test-side view of the backend behind a store: what it has left half-done."""

    store: ArtifactStore
    server: MotoS3Server | None

    def unfinished_uploads(self) -> list[str]:
        """Staging files (local) or open multipart uploads (S3) under the store."""
        if isinstance(self.store, LocalArtifactStore):
            return sorted(os.listdir(self.store.root / ".partial"))
        assert isinstance(self.store, S3ArtifactStore) and self.server is not None
        response = self.server.client().list_multipart_uploads(Bucket=self.store.bucket, Prefix=f"{self.store.prefix}/")
        return [upload["Key"] for upload in response.get("Uploads", [])]


@pytest.fixture
def backend(artifact_store: ArtifactStore, request: pytest.FixtureRequest) -> Backend:
    server = request.getfixturevalue("moto_s3_server") if isinstance(artifact_store, S3ArtifactStore) else None
    return Backend(artifact_store, server)


class FailingReader:
    """A binary stream that yields `fail_after` bytes, then fails like a dropped connection."""

    def __init__(self, fail_after: int) -> None:
        self._remaining = fail_after
        self.delivered = 0

    def read(self, size: int = -1) -> bytes:
        if self._remaining <= 0:
            raise ConnectionResetError("source connection reset by peer")
        count = min(self._remaining, 256 * 1024 if size < 0 else size)
        self._remaining -= count
        self.delivered += count
        return b"x" * count


# --- round trips --------------------------------------------------------------------------------------------------


def test_bytes_round_trip_records_sha256(artifact_store: ArtifactStore) -> None:
    data = _random_bytes(70_000) + b"\x00\xff"
    key = "cycles/c1/episodes/e1/blob.bin"

    info = artifact_store.put_bytes(key, data)

    assert info == ArtifactInfo(uri=artifact_store.uri(key), key=key, sha256=_sha256(data), size=len(data))
    assert info.uri == f"{artifact_store.url}/{key}"
    assert artifact_store.exists(key)
    assert artifact_store.get_bytes(key) == data
    assert artifact_store.info(key) == info


def test_put_replaces_previous_version(artifact_store: ArtifactStore) -> None:
    artifact_store.put_bytes("status.json", b"old")
    new = artifact_store.put_bytes("status.json", b"newer content")

    assert artifact_store.get_bytes("status.json") == b"newer content"
    assert artifact_store.info("status.json") == new
    assert artifact_store.list() == ["status.json"]


def test_json_is_stored_canonically(artifact_store: ArtifactStore) -> None:
    value = {"b": [1, {"z": 1.5, "y": "é"}], "a": None}
    same_value_other_order = {"a": None, "b": [1, {"y": "é", "z": 1.5}]}

    first = artifact_store.put_json("one.json", value)
    second = artifact_store.put_json("two.json", same_value_other_order)

    assert artifact_store.get_bytes("one.json") == '{"a":null,"b":[1,{"y":"é","z":1.5}]}'.encode()
    assert first.sha256 == second.sha256
    assert artifact_store.get_json("two.json") == value


@pytest.mark.parametrize("value", [float("nan"), {"x": object()}, {1: "int key", "b": "str key"}])
def test_put_json_refuses_what_json_cannot_hold(artifact_store: ArtifactStore, value: Any) -> None:
    with pytest.raises(ArtifactFormatError, match=r"cannot store 'bad\.json' as JSON"):
        artifact_store.put_json("bad.json", value)
    assert not artifact_store.exists("bad.json")


def test_get_json_names_the_artifact_when_it_is_not_json(artifact_store: ArtifactStore) -> None:
    artifact_store.put_bytes("notes.txt", b"plain {text")
    with pytest.raises(ArtifactFormatError, match=r"notes\.txt is not valid JSON"):
        artifact_store.get_json("notes.txt")


def test_put_bytes_refuses_text(artifact_store: ArtifactStore) -> None:
    with pytest.raises(ArtifactSourceError, match="needs bytes, got str"):
        artifact_store.put_bytes("text.txt", "not bytes")  # type: ignore[arg-type]


def test_file_round_trip(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    data = _random_bytes(3 * MiB + 17, seed=1)
    source = tmp_path / "source.bin"
    source.write_bytes(data)

    stored = artifact_store.put_file("checkpoints/step-10/adapter.safetensors", source)
    dest = tmp_path / "download" / "nested" / "adapter.safetensors"
    fetched = artifact_store.get_file("checkpoints/step-10/adapter.safetensors", dest)

    assert stored.sha256 == fetched.sha256 == _sha256(data)
    assert stored.size == fetched.size == len(data)
    assert dest.read_bytes() == data
    assert os.listdir(dest.parent) == ["adapter.safetensors"]  # no temp file left beside it


def test_put_file_refuses_a_missing_source(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    with pytest.raises(ArtifactSourceError, match="does not exist"):
        artifact_store.put_file("x.bin", tmp_path / "absent.bin")
    with pytest.raises(ArtifactSourceError, match="is not a regular file"):
        artifact_store.put_file("x.bin", tmp_path)
    assert artifact_store.list() == []


def test_large_object_streams_in_chunks(artifact_store: ArtifactStore) -> None:
    data = _random_bytes(5 * MiB + 123, seed=2)
    artifact_store.put_stream("big.bin", io.BytesIO(data))

    digest = hashlib.sha256()
    chunks = 0
    with artifact_store.open_read("big.bin") as stream:
        while chunk := stream.read(256 * 1024):
            assert len(chunk) <= 256 * 1024
            digest.update(chunk)
            chunks += 1

    assert digest.hexdigest() == _sha256(data)
    assert chunks == -(-len(data) // (256 * 1024))


# --- folders as tarballs -----------------------------------------------------------------------------------------


def _make_tree(root: Path, *, reverse: bool = False) -> None:
    """A small workspace: nested files, an empty folder, an executable, a non-ASCII name, an internal link.

    `reverse` builds the same tree in the opposite order (different inodes and directory order on disk).
    """
    files = {
        "src/pkg/module.py": b"print('hi')\n",
        "data.bin": bytes(range(256)) * 64,
        "run.sh": b"#!/bin/sh\necho ok\n",
        "ünï côde.txt": b"text",
    }
    root.mkdir(parents=True)
    for relative in reversed(list(files)) if reverse else list(files):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(files[relative])
    (root / "run.sh").chmod(0o755)
    (root / "empty").mkdir()
    os.symlink("src/pkg/module.py", root / "link-to-module")


def _snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Path → what matters of it: kind, content or link target, and whether it is executable."""
    result: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            relative = path.relative_to(root).as_posix()
            if path.is_symlink():
                result[relative] = ("link", os.readlink(path))
            elif path.is_dir():
                result[relative] = ("dir",)
            else:
                result[relative] = ("file", path.read_bytes(), bool(path.stat().st_mode & 0o100))
    return result


def test_dir_round_trip(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    _make_tree(tmp_path / "workspace")

    stored = artifact_store.put_dir("episodes/e1/workspace.tar.gz", tmp_path / "workspace")
    fetched = artifact_store.get_dir("episodes/e1/workspace.tar.gz", tmp_path / "restored" / "workspace")

    assert fetched.sha256 == stored.sha256 == _sha256(artifact_store.get_bytes("episodes/e1/workspace.tar.gz"))
    assert _snapshot(tmp_path / "restored" / "workspace") == _snapshot(tmp_path / "workspace")
    assert _snapshot(tmp_path / "restored" / "workspace")["run.sh"][2] is True
    assert os.listdir(tmp_path / "restored") == ["workspace"]  # the scratch folder is gone


def test_same_tree_gives_same_sha256(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    _make_tree(tmp_path / "a")
    _make_tree(tmp_path / "b", reverse=True)
    os.utime(tmp_path / "b" / "data.bin", (1_000_000, 1_000_000))
    (tmp_path / "b" / "data.bin").chmod(0o600)

    first = artifact_store.put_dir("a.tar.gz", tmp_path / "a")
    second = artifact_store.put_dir("b.tar.gz", tmp_path / "b")
    (tmp_path / "b" / "data.bin").write_bytes(b"changed")
    third = artifact_store.put_dir("c.tar.gz", tmp_path / "b")

    assert first.sha256 == second.sha256
    assert artifact_store.get_bytes("a.tar.gz") == artifact_store.get_bytes("b.tar.gz")
    assert third.sha256 != first.sha256


def test_get_dir_refuses_a_non_empty_destination(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    _make_tree(tmp_path / "workspace")
    artifact_store.put_dir("w.tar.gz", tmp_path / "workspace")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")

    with pytest.raises(ArtifactSourceError, match="not an empty folder"):
        artifact_store.get_dir("w.tar.gz", occupied)
    assert os.listdir(occupied) == ["keep.txt"]

    (tmp_path / "empty").mkdir()
    artifact_store.get_dir("w.tar.gz", tmp_path / "empty")
    assert (tmp_path / "empty" / "run.sh").is_file()


def test_put_dir_refuses_links_leaving_the_folder(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    _make_tree(tmp_path / "workspace")
    os.symlink("/usr/bin/env", tmp_path / "workspace" / "python")

    with pytest.raises(ArtifactSourceError, match="link 'python' points outside"):
        artifact_store.put_dir("w.tar.gz", tmp_path / "workspace")
    assert not artifact_store.exists("w.tar.gz")

    artifact_store.put_dir("w.tar.gz", tmp_path / "workspace", skip_escaping_links=True)
    artifact_store.get_dir("w.tar.gz", tmp_path / "restored")
    assert not (tmp_path / "restored" / "python").is_symlink()
    assert (tmp_path / "restored" / "link-to-module").is_symlink()


def _tarball(entries: list[tuple[str, str, Any]]) -> bytes:
    """A tar.gz built member by member, so it can hold what a well-behaved archiver never writes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for kind, name, payload in entries:
            member = tarfile.TarInfo(name)
            member.mode = 0o644
            if kind == "file":
                member.size = len(payload)
                tar.addfile(member, io.BytesIO(payload))
                continue
            member.type = {
                "dir": tarfile.DIRTYPE,
                "symlink": tarfile.SYMTYPE,
                "hardlink": tarfile.LNKTYPE,
                "chardev": tarfile.CHRTYPE,
                "fifo": tarfile.FIFOTYPE,
            }[kind]
            member.linkname = payload or ""
            tar.addfile(member)
    return buffer.getvalue()


MALICIOUS_ARCHIVES: dict[str, Any] = {
    "absolute path": lambda outside: [("file", f"{outside}/escaped.txt", b"pwned")],
    "dot-dot path": lambda outside: [("file", "ok.txt", b"fine"), ("file", "../../escaped.txt", b"pwned")],
    "absolute link": lambda outside: [("symlink", "evil", str(outside))],
    "link out by dot-dot": lambda outside: [("symlink", "evil", "../../..")],
    "write through a link": lambda outside: [("dir", "sub", None), ("symlink", "lnk", "sub"), ("file", "lnk/x", b"x")],
    "link chain": lambda outside: [("symlink", "a", "."), ("symlink", "b", "a/a/a/..")],
    "link chain, reordered": lambda outside: [("symlink", "b", "a/a/a/.."), ("symlink", "a", ".")],
    "hard link outside": lambda outside: [("hardlink", "h", f"{outside}/secret.txt")],
    "hard link to a link": lambda outside: [("symlink", "s", "x"), ("hardlink", "h", "s")],
    "device": lambda outside: [("chardev", "null", None)],
    "fifo": lambda outside: [("fifo", "pipe", None)],
    "duplicate member": lambda outside: [("file", "x", b"one"), ("file", "x", b"two")],
}


@pytest.mark.parametrize("kind", sorted(MALICIOUS_ARCHIVES))
def test_get_dir_refuses_malicious_tarballs(artifact_store: ArtifactStore, tmp_path: Path, kind: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    artifact_store.put_bytes("evil.tar.gz", _tarball(MALICIOUS_ARCHIVES[kind](outside)))

    with pytest.raises(UnsafeArchiveError, match=r"refusing to extract .*evil\.tar\.gz"):
        artifact_store.get_dir("evil.tar.gz", tmp_path / "extract" / "out")

    assert os.listdir(tmp_path / "extract") == []  # neither the destination nor the scratch folder remains
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    assert not any(path.name == "escaped.txt" for path in tmp_path.rglob("*"))


def test_get_dir_of_something_else_than_a_tarball(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    artifact_store.put_bytes("not-a-tarball.tar.gz", b"just bytes")
    with pytest.raises(ArtifactFormatError, match=r"is not a valid tar\.gz archive"):
        artifact_store.get_dir("not-a-tarball.tar.gz", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- keys and listing --------------------------------------------------------------------------------------------

BAD_KEYS = [
    "",
    "/etc/passwd",
    "a/../b",
    "..",
    "./a",
    "a/./b",
    "a//b",
    "a/",
    "a\\b",
    "a\x00b",
    "line\nbreak",
    "del\x7f",
    ".partial/x",
    ".meta/x",
    ".probe/x",
    "x" * 1025,
    "long/" + "y" * 256,
    "\ud800",
]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_invalid_keys_are_refused(artifact_store: ArtifactStore, key: str) -> None:
    for call in (
        lambda: artifact_store.put_bytes(key, b"data"),
        lambda: artifact_store.get_bytes(key),
        lambda: artifact_store.exists(key),
        lambda: artifact_store.delete(key),
        lambda: artifact_store.uri(key),
    ):
        with pytest.raises(ArtifactKeyError, match="invalid artifact key") as caught:
            call()
        assert isinstance(caught.value, ValueError)
    assert artifact_store.list() == []


@pytest.mark.parametrize("key", ["a", "v1.0/a-b_c.json", "ünï/日本.txt", ".hidden/x", "a/..dots../b", "a b/c"])
def test_valid_keys_round_trip(artifact_store: ArtifactStore, key: str) -> None:
    artifact_store.put_bytes(key, key.encode())
    assert artifact_store.get_bytes(key) == key.encode()
    assert artifact_store.list() == [key]


def test_list_by_prefix(artifact_store: ArtifactStore, backend: Backend) -> None:
    keys = [
        "cycles/c1/episodes/e1/status.json",
        "cycles/c1/episodes/e2/status.json",
        "cycles/c1/report.json",
        "cycles/c10/report.json",
        "cycles/c2/x",
        "top.json",
    ]
    for key in reversed(keys):
        artifact_store.put_bytes(key, b"{}")

    assert artifact_store.list() == keys
    assert artifact_store.list("cycles/c1/") == keys[:3]
    assert artifact_store.list("cycles/c1") == keys[:4]
    assert artifact_store.list("cycles/c1/episodes/e") == keys[:2]
    assert artifact_store.list("nothing/") == []
    with pytest.raises(ArtifactKeyError, match="invalid artifact prefix"):
        artifact_store.list("../")


def test_unfinished_uploads_are_never_listed(artifact_store: ArtifactStore, backend: Backend) -> None:
    artifact_store.put_bytes("done.bin", b"complete")
    upload_id = None
    if isinstance(artifact_store, LocalArtifactStore):
        (artifact_store.root / ".partial" / "put-crashed.partial").write_bytes(b"half")
    else:
        assert isinstance(artifact_store, S3ArtifactStore) and backend.server is not None
        upload_id = backend.server.client().create_multipart_upload(
            Bucket=artifact_store.bucket, Key=f"{artifact_store.prefix}/pending.bin"
        )["UploadId"]

    assert artifact_store.list() == ["done.bin"]
    assert not artifact_store.exists("pending.bin")
    assert len(backend.unfinished_uploads()) == 1
    if upload_id is not None:
        backend.server.client().abort_multipart_upload(
            Bucket=artifact_store.bucket, Key=f"{artifact_store.prefix}/pending.bin", UploadId=upload_id
        )


def test_missing_artifacts(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    uri = artifact_store.uri("absent/thing.bin")
    for call in (
        lambda: artifact_store.get_bytes("absent/thing.bin"),
        lambda: artifact_store.info("absent/thing.bin"),
        lambda: artifact_store.open_read("absent/thing.bin"),
        lambda: artifact_store.get_file("absent/thing.bin", tmp_path / "dest.bin"),
        lambda: artifact_store.get_dir("absent/thing.bin", tmp_path / "dest"),
    ):
        with pytest.raises(ArtifactNotFoundError, match="does not exist") as caught:
            call()
        assert uri in str(caught.value)
        assert isinstance(caught.value, FileNotFoundError)
    assert not artifact_store.exists("absent/thing.bin")
    artifact_store.delete("absent/thing.bin")  # deleting what is not there is fine
    assert not (tmp_path / "dest.bin").exists()
    assert not (tmp_path / "dest").exists()


def test_delete(artifact_store: ArtifactStore) -> None:
    artifact_store.put_bytes("folder/a.bin", b"a")
    artifact_store.put_bytes("folder/b.bin", b"b")

    artifact_store.delete("folder/a.bin")
    assert not artifact_store.exists("folder/a.bin")
    assert artifact_store.list() == ["folder/b.bin"]

    artifact_store.delete("folder/b.bin")
    assert artifact_store.list() == []
    # The name of the emptied folder can now hold an artifact itself.
    artifact_store.put_bytes("folder", b"now a file")
    assert artifact_store.get_bytes("folder") == b"now a file"


# --- atomicity and integrity -------------------------------------------------------------------------------------


@pytest.mark.parametrize("previous", [None, b"previous version"])
def test_interrupted_upload_leaves_nothing_visible(
    artifact_store: ArtifactStore, backend: Backend, previous: bytes | None
) -> None:
    if previous is not None:
        artifact_store.put_bytes("episode/stream.jsonl", previous)
    reader = FailingReader(fail_after=3 * MiB)

    with pytest.raises(ConnectionResetError):
        artifact_store.put_stream("episode/stream.jsonl", reader)

    assert reader.delivered == 3 * MiB  # it really failed midway
    assert artifact_store.exists("episode/stream.jsonl") is (previous is not None)
    assert artifact_store.list() == (["episode/stream.jsonl"] if previous else [])
    if previous is not None:
        assert artifact_store.get_bytes("episode/stream.jsonl") == previous
    assert backend.unfinished_uploads() == []


def test_corrupted_bytes_are_detected_on_read(artifact_store: ArtifactStore, backend: Backend, tmp_path: Path) -> None:
    data = _random_bytes(200_000, seed=3)
    artifact_store.put_bytes("model/weights.bin", data)
    tampered = data[:1000] + bytes([data[1000] ^ 0xFF]) + data[1001:]
    if isinstance(artifact_store, LocalArtifactStore):
        # Bit rot: same inode, size and mtime, different bytes.
        path = artifact_store.root / "model" / "weights.bin"
        before = path.stat()
        with path.open("r+b") as handle:
            handle.write(tampered)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    else:
        assert isinstance(artifact_store, S3ArtifactStore) and backend.server is not None
        backend.server.client().put_object(
            Bucket=artifact_store.bucket,
            Key=f"{artifact_store.prefix}/model/weights.bin",
            Body=tampered,
            Metadata={"sha256": _sha256(data)},
        )

    with pytest.raises(ArtifactIntegrityError, match="does not match its recorded SHA-256"):
        artifact_store.get_bytes("model/weights.bin")
    with pytest.raises(ArtifactIntegrityError):
        artifact_store.get_file("model/weights.bin", tmp_path / "weights.bin")
    assert not (tmp_path / "weights.bin").exists()


@pytest.mark.parametrize("edit", ["truncate", "append", "rewrite", "replace"])
def test_local_edit_made_outside_the_store_is_refused_and_not_recorded(
    local_artifact_url: str, tmp_path: Path, edit: str
) -> None:
    store = open_artifact_store(local_artifact_url)
    assert isinstance(store, LocalArtifactStore)
    store.put_bytes("notes.txt", b"written by the store")
    path = store.root / "notes.txt"
    if edit == "truncate":
        with path.open("r+b") as handle:
            handle.truncate(7)
    elif edit == "append":
        with path.open("ab") as handle:
            handle.write(b" and more")
    elif edit == "rewrite":
        path.write_bytes(b"written by hand!!!!!")  # same size, new bytes
    else:
        (store.root / "replacement.tmp").write_bytes(b"replaced by hand")
        os.replace(store.root / "replacement.tmp", path)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 5_000_000_000))

    for _ in range(2):  # the first refusal must not record the new bytes as the artifact's hash
        with pytest.raises(ArtifactIntegrityError, match=r"notes\.txt does not match its recorded SHA-256") as caught:
            store.info("notes.txt")
        assert "\n" not in str(caught.value)
        with pytest.raises(ArtifactIntegrityError, match="does not match its recorded SHA-256"):
            store.get_bytes("notes.txt")
        with pytest.raises(ArtifactIntegrityError):
            store.get_file("notes.txt", tmp_path / "notes.txt")
        assert not (tmp_path / "notes.txt").exists()
    assert isinstance(caught.value, InfrastructureError)


def test_local_touched_or_copied_artifacts_still_read(local_artifact_url: str, tmp_path: Path) -> None:
    store = open_artifact_store(local_artifact_url)
    assert isinstance(store, LocalArtifactStore)
    store.put_bytes("a/notes.txt", b"published")
    os.utime(store.root / "a" / "notes.txt", (1_000_000, 1_000_000))  # same bytes, new mtime
    assert store.get_bytes("a/notes.txt") == b"published"
    assert store.info("a/notes.txt").sha256 == _sha256(b"published")

    copy = tmp_path / "copied"
    shutil.copytree(store.root, copy)  # new inodes everywhere: the bytes prove they are the published version
    copied = LocalArtifactStore(copy)
    assert copied.get_bytes("a/notes.txt") == b"published"
    assert copied.info("a/notes.txt").sha256 == _sha256(b"published")


def test_local_previous_version_reads_while_a_put_is_between_record_and_rename(local_artifact_url: str) -> None:
    store = open_artifact_store(local_artifact_url)
    assert isinstance(store, LocalArtifactStore)
    store.put_bytes("k.bin", b"version one")
    # A second put recorded its version and then died before its rename: the published file is still version one.
    staged = store.root / ".partial" / "put-dead.partial"
    staged.write_bytes(b"version two")
    store._write_record("k.bin", _sha256(b"version two"), staged.stat())

    assert store.get_bytes("k.bin") == b"version one"
    assert store.info("k.bin").sha256 == _sha256(b"version one")
    store.put_bytes("k.bin", b"version two")
    assert store.get_bytes("k.bin") == b"version two"


def test_a_legacy_record_is_still_honoured(local_artifact_url: str) -> None:
    store = open_artifact_store(local_artifact_url)
    assert isinstance(store, LocalArtifactStore)
    store.put_bytes("old.bin", b"from before per-version records")
    shutil.rmtree(store._records_dir("old.bin"))
    stat = (store.root / "old.bin").stat()
    legacy = {"key": "old.bin", "sha256": _sha256(b"something else"), **LocalArtifactStore._identity(stat)}
    store._legacy_record_path("old.bin").write_text(json.dumps(legacy))
    with pytest.raises(ArtifactIntegrityError):
        store.get_bytes("old.bin")


def test_the_hash_a_metadata_row_recorded_is_checked(artifact_store: ArtifactStore, tmp_path: Path) -> None:
    info = artifact_store.put_bytes("rows/prompt.txt", b"the prompt")
    assert artifact_store.get_bytes("rows/prompt.txt", sha256=info.sha256) == b"the prompt"
    wrong = _sha256(b"another prompt")
    with pytest.raises(ArtifactIntegrityError, match="in the metadata store"):
        artifact_store.get_bytes("rows/prompt.txt", sha256=wrong)
    with pytest.raises(ArtifactIntegrityError, match="in the metadata store"):
        artifact_store.get_file("rows/prompt.txt", tmp_path / "prompt.txt", sha256=wrong)
    assert not (tmp_path / "prompt.txt").exists()
    with pytest.raises(ArtifactIntegrityError), artifact_store.open_read("rows/prompt.txt", sha256=wrong) as stream:
        stream.read()


def test_local_concurrent_puts_of_one_key(local_artifact_url: str) -> None:
    store = open_artifact_store(local_artifact_url)
    assert isinstance(store, LocalArtifactStore)
    payloads = [_random_bytes(100_000 + index, seed=index) for index in range(8)]
    errors: list[BaseException] = []

    def put(payload: bytes) -> None:
        try:
            for _ in range(5):
                store.put_bytes("shared/key.bin", payload)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(payload,)) for payload in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    final = store.get_bytes("shared/key.bin")  # verified against the record: no torn pairing
    assert final in payloads
    assert store.info("shared/key.bin").sha256 == _sha256(final)
    assert os.listdir(store.root / ".partial") == []


def test_local_key_that_is_a_folder_of_other_keys(local_artifact_url: str) -> None:
    store = open_artifact_store(local_artifact_url)
    store.put_bytes("run/a.json", b"{}")
    with pytest.raises(ArtifactKeyError, match="already a folder of other artifacts"):
        store.put_bytes("run", b"x")
    with pytest.raises(ArtifactKeyError, match="parent of it is already an artifact"):
        store.put_bytes("run/a.json/b", b"x")
    assert store.list() == ["run/a.json"]


# --- S3 specifics ------------------------------------------------------------------------------------------------


def _s3_store(url: str, **options: Any) -> S3ArtifactStore:
    """The store at `url`, opened from the environment, or built directly when `options` override settings."""
    if not options:
        store = open_artifact_store(url)
        assert isinstance(store, S3ArtifactStore)
        return store
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return S3ArtifactStore(bucket, prefix, **options)


def test_s3_multipart_above_threshold(
    s3_artifact_url: str, moto_s3_server: MotoS3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MASS_S3_MULTIPART_THRESHOLD", str(1 * MiB))
    store = _s3_store(s3_artifact_url)
    data = _random_bytes(11 * MiB, seed=4)
    (tmp_path / "shard.safetensors").write_bytes(data)

    info = store.put_file("exports/L1/shard.safetensors", tmp_path / "shard.safetensors")
    small = store.put_bytes("exports/L1/config.json", b"{}")

    head = moto_s3_server.client().head_object(Bucket=store.bucket, Key=f"{store.prefix}/exports/L1/shard.safetensors")
    assert head["ETag"].strip('"').endswith("-2")  # two parts: 8 MiB + 3 MiB
    assert head["Metadata"]["sha256"] == info.sha256 == _sha256(data)
    small_head = moto_s3_server.client().head_object(Bucket=store.bucket, Key=f"{store.prefix}/exports/L1/config.json")
    assert "-" not in small_head["ETag"]  # one PUT below the threshold
    assert small.sha256 == _sha256(b"{}")
    assert store.get_file("exports/L1/shard.safetensors", tmp_path / "copy").sha256 == info.sha256
    assert (tmp_path / "copy").read_bytes() == data


def test_s3_interrupted_multipart_upload_is_aborted(
    s3_artifact_url: str, moto_s3_server: MotoS3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MASS_S3_MULTIPART_THRESHOLD", str(1 * MiB))
    store = _s3_store(s3_artifact_url)
    store.put_bytes("checkpoint.bin", b"previous checkpoint")
    (tmp_path / "checkpoint.bin").write_bytes(_random_bytes(12 * MiB, seed=5))
    parts_seen: list[int] = []

    def cut_connection_on_part_two(params: dict[str, Any], **_: Any) -> None:
        parts_seen.append(params["PartNumber"])
        if params["PartNumber"] == 2:
            raise ConnectionResetError("connection reset while sending part 2")

    # botocore's event hooks are its supported way to intercept a request before it is sent.
    store._client.meta.events.register("provide-client-params.s3.UploadPart", cut_connection_on_part_two)
    with pytest.raises(ConnectionResetError):
        store.put_file("checkpoint.bin", tmp_path / "checkpoint.bin")

    assert sorted(parts_seen) == [1, 2]
    assert store.get_bytes("checkpoint.bin") == b"previous checkpoint"
    assert store.list() == ["checkpoint.bin"]
    uploads = moto_s3_server.client().list_multipart_uploads(Bucket=store.bucket, Prefix=f"{store.prefix}/")
    assert uploads.get("Uploads", []) == []


def test_s3_file_changing_during_upload_is_refused(
    s3_artifact_url: str, moto_s3_server: MotoS3Server, tmp_path: Path
) -> None:
    store = _s3_store(s3_artifact_url, multipart_threshold=1 * MiB, max_concurrency=1)
    source = tmp_path / "growing.log"
    source.write_bytes(_random_bytes(17 * MiB, seed=6))

    def append_while_part_one_uploads(params: dict[str, Any], **_: Any) -> None:
        if params["PartNumber"] == 1:
            with source.open("ab") as handle:
                handle.write(b"late line\n")

    store._client.meta.events.register("provide-client-params.s3.UploadPart", append_while_part_one_uploads)
    with pytest.raises(ArtifactSourceError, match="changed while it was being stored"):
        store.put_file("logs/growing.log", source)

    assert not store.exists("logs/growing.log")
    uploads = moto_s3_server.client().list_multipart_uploads(Bucket=store.bucket, Prefix=f"{store.prefix}/")
    assert uploads.get("Uploads", []) == []


def test_s3_missing_bucket_is_a_config_error(s3_environment: MotoS3Server) -> None:
    store = open_artifact_store("s3://no-such-bucket-here/prefix")
    with pytest.raises(ArtifactStoreConfigError, match=r"'no-such-bucket-here' .* does not exist"):
        store.put_bytes("a.bin", b"x")


@pytest.mark.parametrize("raw", ["lots", "0", "-5", "1.5"])
def test_s3_bad_multipart_threshold_setting(
    s3_environment: MotoS3Server, monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv("MASS_S3_MULTIPART_THRESHOLD", raw)
    with pytest.raises(ArtifactStoreConfigError, match="MASS_S3_MULTIPART_THRESHOLD"):
        open_artifact_store(f"s3://{s3_environment.bucket}/p")


# --- opening stores by URL ---------------------------------------------------------------------------------------


def test_open_store_by_url(s3_environment: MotoS3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s3 = open_artifact_store(f"s3://{s3_environment.bucket}/some/prefix/")
    assert isinstance(s3, S3ArtifactStore)
    assert (s3.url, s3.bucket, s3.prefix) == (
        f"s3://{s3_environment.bucket}/some/prefix",
        s3_environment.bucket,
        "some/prefix",
    )
    assert s3.uri("a/b.json") == f"s3://{s3_environment.bucket}/some/prefix/a/b.json"
    bucket_root = open_artifact_store(f"s3://{s3_environment.bucket}")
    assert bucket_root.uri("k") == f"s3://{s3_environment.bucket}/k"

    by_file_url = open_artifact_store((tmp_path / "by url").as_uri())
    assert isinstance(by_file_url, LocalArtifactStore)
    assert by_file_url.root == tmp_path / "by url"
    assert by_file_url.root.is_dir()

    monkeypatch.chdir(tmp_path)
    relative = open_artifact_store("relative/store")
    assert isinstance(relative, LocalArtifactStore)
    assert relative.root == tmp_path / "relative" / "store"
    assert relative.url == (tmp_path / "relative" / "store").as_uri()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("", "URL is empty"),
        ("   ", "URL is empty"),
        ("http://example.com/artifacts", "unsupported artifact store URL scheme 'http'"),
        ("gs://bucket/prefix", "unsupported artifact store URL scheme 'gs'"),
        ("s3://", "invalid S3 bucket name ''"),
        ("s3://Bad_Bucket/prefix", "invalid S3 bucket name"),
        ("s3://ab/prefix", "invalid S3 bucket name"),
        ("s3://bucket:9000/prefix", "names a port"),
        ("s3://bucket/prefix?X-Amz-Signature=abc", "must not have a query string"),
        ("s3://bucket/a//b", "invalid S3 prefix"),
        ("s3://bucket/../up", "invalid S3 prefix"),
        ("file://fileserver/share", "names host 'fileserver'"),
        ("file:relative/path", "must hold an absolute path"),
    ],
)
def test_bad_store_urls(url: str, message: str) -> None:
    with pytest.raises(ArtifactStoreConfigError, match=message):
        open_artifact_store(url)


@pytest.mark.parametrize(
    "url", ["s3://AKIAEXAMPLEKEY:hunter2secret@bucket/prefix", "https://user:hunter2secret@minio.local/bucket"]
)
def test_credentials_in_store_urls_are_refused_without_echo(url: str) -> None:
    with pytest.raises(ArtifactStoreConfigError) as caught:
        open_artifact_store(url)
    assert "hunter2secret" not in str(caught.value)
    assert "AKIAEXAMPLEKEY" not in str(caught.value)


# --- secrets -----------------------------------------------------------------------------------------------------


def test_no_credential_reaches_artifacts_reprs_or_logs(
    s3_artifact_url: str,
    moto_s3_server: MotoS3Server,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Kept last in the module: it also scans every object the S3 tests before it stored in the bucket."""
    caplog.set_level(logging.DEBUG, logger="mass_ops")
    monkeypatch.setenv("MASS_S3_MULTIPART_THRESHOLD", str(1 * MiB))
    store = _s3_store(s3_artifact_url)
    _make_tree(tmp_path / "workspace")
    (tmp_path / "big.bin").write_bytes(_random_bytes(6 * MiB, seed=7))
    texts = [repr(store), str(store), store.url]
    texts += [repr(store.put_bytes("a.bin", b"a")), repr(store.put_json("b.json", {"k": "v"}))]
    texts += [
        repr(store.put_dir("w.tar.gz", tmp_path / "workspace")),
        repr(store.put_file("big.bin", tmp_path / "big.bin")),
    ]
    texts += [repr(store.info("big.bin")), *store.list()]
    for failing in (lambda: store.get_bytes("absent"), lambda: open_artifact_store("s3://no-such-bucket-xyz/p").list()):
        with pytest.raises(ArtifactError) as caught:
            failing()
        texts.append(str(caught.value))
    texts.append(caplog.text)

    client = moto_s3_server.client()
    stored = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=moto_s3_server.bucket):
        for item in page.get("Contents", []):
            response = client.get_object(Bucket=moto_s3_server.bucket, Key=item["Key"])
            texts += [item["Key"], repr(response["Metadata"])]
            texts.append(response["Body"].read().decode("latin-1"))
            stored += 1

    assert stored >= 4
    assert "stored s3://" in caplog.text  # the store did log, so the scan below covers real log lines
    for secret in (moto_s3_server.access_key_id, moto_s3_server.secret_access_key):
        assert not any(secret in text for text in texts)


def test_an_empty_folder_round_trips(artifact_store, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    artifact_store.put_dir("episodes/e1/workspace.tar.gz", empty)
    dest = tmp_path / "restored"
    artifact_store.get_dir("episodes/e1/workspace.tar.gz", dest)
    assert dest.is_dir() and not any(dest.iterdir())


def test_get_json_reads_an_artifact_as_untrusted_json(artifact_store: ArtifactStore) -> None:
    artifact_store.put_bytes("deep.json", b"[" * 100_000 + b"]" * 100_000)  # an episode's document, from its pod
    with pytest.raises(ArtifactFormatError, match=r"deep\.json is not valid JSON: JSON nested deeper than the parser"):
        artifact_store.get_json("deep.json")
    artifact_store.put_bytes("big.json", b'"' + b"x" * (3 << 20) + b'"')
    with pytest.raises(ArtifactFormatError, match=r"big\.json is not valid JSON: over the 1,048,576-byte limit"):
        artifact_store.get_json("big.json", max_bytes=1 << 20)
    artifact_store.put_bytes("ok.json", b'{"a": [1]}')
    assert artifact_store.get_json("ok.json") == {"a": [1]}
