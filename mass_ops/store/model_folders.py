"""Models in the artifact store: a folder of files under a key prefix, made visible by its `manifest.json`.

A published model is every file under ``<prefix>/<relative path>``, then — last — ``<prefix>/manifest.json``
(format ``mass-ops-model/1``: files with SHA-256 and size, total size, metadata). Readers start from the manifest
and check every file against it; republishing the same files is a no-op, different files are refused. A model
location is a relative key, an ``s3://`` URI (another bucket is opened as a store root) or a local folder (absolute
path or ``file://``, used in place). Manifest format and locations: docs/storage.md (`mass_ops.store.model_folders`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from mass_ops.errors import InputError
from mass_ops.store.artifact_backends import open_artifact_store
from mass_ops.store.artifacts import (
    ArtifactFormatError,
    ArtifactNotFoundError,
    ArtifactStore,
    canonical_json,
    file_sha256,
    key_problem,
)

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "mass-ops-model/1"
# Suffixes of weight files; everything else in a model folder (configs, tokenizer, chat template) is a side file.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


class ModelStoreError(InputError):
    """A model location, manifest or folder that cannot be used; the message names the location and why."""


@dataclass(frozen=True)
class ModelFile:
    """One file of a model: its path relative to the model folder, SHA-256 (hex) and size in bytes."""

    name: str
    sha256: str
    size: int

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "size": self.size}


@dataclass(frozen=True)
class ModelManifest:
    """The files of a published model and free-form metadata (e.g. where the model came from)."""

    files: tuple[ModelFile, ...]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "files": [f.as_dict() for f in self.files],
            "total_size": self.total_size,
            "metadata": self.metadata,
        }

    def digest(self) -> str:
        """SHA-256 of the canonical manifest: one value naming exactly this model (files and metadata)."""
        return hashlib.sha256(canonical_json(self.as_dict())).hexdigest()

    def same_files(self, other: ModelManifest) -> bool:
        return self.files == other.files

    def file(self, name: str) -> ModelFile | None:
        return next((f for f in self.files if f.name == name), None)

    @classmethod
    def from_dict(cls, data: Any, *, where: str) -> ModelManifest:
        """Parse a manifest document; `ModelStoreError` naming `where` when it is malformed."""
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ModelStoreError(f"{where}: not a {MANIFEST_FORMAT} manifest")
        rows = data.get("files")
        if not isinstance(rows, list):
            raise ModelStoreError(f"{where}: 'files' must be a list")
        files = []
        for index, row in enumerate(rows):
            ok = (
                isinstance(row, dict)
                and isinstance(row.get("name"), str)
                and key_problem(row["name"]) is None
                and isinstance(row.get("sha256"), str)
                and len(row["sha256"]) == 64
                and isinstance(row.get("size"), int)
                and not isinstance(row.get("size"), bool)
                and row["size"] >= 0
            )
            if not ok:
                raise ModelStoreError(f"{where}: file entry #{index} is not {{name, sha256, size}} with a safe name")
            files.append(ModelFile(row["name"], row["sha256"], row["size"]))
        names = [f.name for f in files]
        if len(set(names)) != len(names) or MANIFEST_NAME in names:
            raise ModelStoreError(f"{where}: file names repeat or include {MANIFEST_NAME}")
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ModelStoreError(f"{where}: 'metadata' must be an object")
        return cls(tuple(files), metadata)


@dataclass(frozen=True)
class ModelLocation:
    """Where a model lives: a prefix of an artifact store (`store` set) or a local folder (`path` set)."""

    uri: str
    store: ArtifactStore | None = None
    prefix: str = ""
    path: Path | None = None

    @property
    def is_local_folder(self) -> bool:
        return self.path is not None

    def key(self, name: str) -> str:
        """Store key of a file of the model."""
        return f"{self.prefix}/{name}" if self.prefix else name


@dataclass(frozen=True)
class PublishedModel:
    """A model made visible at `uri`; `reused` when the identical files were already published there."""

    uri: str
    manifest_uri: str
    manifest: ModelManifest
    reused: bool


def is_side_file(name: str) -> bool:
    """Whether a model file is not a weight file (use as `include` to fetch only configs and the tokenizer)."""
    return not name.lower().endswith(WEIGHT_SUFFIXES)


def resolve_model_location(artifacts: ArtifactStore, location: str) -> ModelLocation:
    """Turn a configured model location into a store prefix or a local folder (see the module docstring)."""
    if not isinstance(location, str) or not location.strip():
        raise ModelStoreError("model location is empty")
    text = location.strip()
    scheme = urlsplit(text).scheme.lower() if "://" in text else ""
    if scheme == "s3":
        uri = text.rstrip("/")
        base = artifacts.url.rstrip("/")
        if uri.startswith(base + "/"):
            return _store_location(artifacts, uri[len(base) + 1 :], location)
        if uri == base:
            raise ModelStoreError(f"model location {location}: the artifact store root cannot hold a model")
        return ModelLocation(uri=uri, store=open_artifact_store(uri), prefix="")
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise ModelStoreError(f"model location {location}: file URIs must name a local path (file:///path)")
        path = Path(unquote(parts.path))
        if not path.is_absolute():
            raise ModelStoreError(f"model location {location}: file URIs must hold an absolute path")
        return ModelLocation(uri=path.as_uri(), path=path)
    if scheme:
        raise ModelStoreError(f"model location {location}: unsupported scheme {scheme!r} (use a key, s3:// or a path)")
    if os.path.isabs(text):
        path = Path(text)
        return ModelLocation(uri=path.as_uri(), path=path)
    return _store_location(artifacts, text.rstrip("/"), location)


def _store_location(artifacts: ArtifactStore, prefix: str, location: str) -> ModelLocation:
    problem = key_problem(prefix)
    if problem is not None:
        raise ModelStoreError(f"model location {location}: not a usable artifact key ({problem})")
    return ModelLocation(uri=artifacts.uri(prefix), store=artifacts, prefix=prefix)


def model_uri(artifacts: ArtifactStore, location: str) -> str:
    """The URI a model location resolves to (what the metadata store records)."""
    return resolve_model_location(artifacts, location).uri


# --- reading manifests ----------------------------------------------------------------------------------------


def read_manifest(artifacts: ArtifactStore, location: str) -> ModelManifest | None:
    """The manifest of the model at `location`, or None when nothing (or only an unfinished publish) is there."""
    return _read_manifest(resolve_model_location(artifacts, location))


def _read_manifest(where: ModelLocation) -> ModelManifest | None:
    if where.path is not None:
        path = where.path / MANIFEST_NAME
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelStoreError(f"{path}: unreadable manifest ({exc})") from None
        return ModelManifest.from_dict(data, where=str(path))
    assert where.store is not None
    key = where.key(MANIFEST_NAME)
    try:
        data = where.store.get_json(key)
    except ArtifactNotFoundError:
        return None
    except ArtifactFormatError as exc:
        raise ModelStoreError(str(exc)) from None
    return ModelManifest.from_dict(data, where=where.store.uri(key))


# --- publishing -----------------------------------------------------------------------------------------------


def folder_manifest(local_dir: str | os.PathLike[str], metadata: Mapping[str, Any] | None = None) -> ModelManifest:
    """The manifest of a local model folder: every regular file (recursively, sorted) except a top-level
    manifest.json, hashed."""
    root = Path(local_dir)
    if not root.is_dir():
        raise ModelStoreError(f"{root}: not a model folder")
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = path.relative_to(root).as_posix()
        if name == MANIFEST_NAME:
            continue  # a fetched folder carries its manifest; it describes the files, it is not one of them
        problem = key_problem(name)
        if problem is not None:
            raise ModelStoreError(f"{path}: file name cannot be stored ({problem})")
        sha256, size = file_sha256(path)
        files.append(ModelFile(name, sha256, size))
    if not files:
        raise ModelStoreError(f"{root}: the folder holds no files to publish")
    return ModelManifest(tuple(files), json.loads(json.dumps(dict(metadata or {}))))


def publish_model(
    artifacts: ArtifactStore,
    location: str,
    local_dir: str | os.PathLike[str],
    *,
    metadata: Mapping[str, Any] | None = None,
) -> PublishedModel:
    """Publish the folder `local_dir` as the model at `location`: files first, manifest.json last.

    Idempotent: the same files already published there → no-op (`reused`; the stored manifest is kept). A different
    published model there → `ModelStoreError`, nothing written. Leftovers of an unfinished publish (files without a
    manifest) are replaced.
    """
    where = resolve_model_location(artifacts, location)
    manifest = folder_manifest(local_dir, metadata)
    existing = _read_manifest(where)
    if existing is not None:
        if existing.same_files(manifest):
            logger.info("model %s already published with the same %d files", where.uri, len(manifest.files))
            return PublishedModel(where.uri, _manifest_uri(where), existing, reused=True)
        raise ModelStoreError(
            f"{where.uri} already holds a different published model ({len(existing.files)} files, manifest "
            f"{existing.digest()[:12]}…); refusing to overwrite it"
        )
    if where.path is not None:
        _publish_local(where.path, Path(local_dir), manifest)
    else:
        _publish_to_store(where, Path(local_dir), manifest)
    logger.info("published model %s (%d files, %d bytes)", where.uri, len(manifest.files), manifest.total_size)
    return PublishedModel(where.uri, _manifest_uri(where), manifest, reused=False)


def _manifest_uri(where: ModelLocation) -> str:
    if where.path is not None:
        return (where.path / MANIFEST_NAME).as_uri()
    assert where.store is not None
    return where.store.uri(where.key(MANIFEST_NAME))


def _publish_to_store(where: ModelLocation, local_dir: Path, manifest: ModelManifest) -> None:
    store = where.store
    assert store is not None
    wanted = {where.key(f.name) for f in manifest.files}
    # Stray files of an unfinished earlier publish would otherwise sit in the folder without being part of it.
    for key in store.list(f"{where.prefix}/" if where.prefix else ""):
        if key not in wanted:
            logger.warning("removing %s: left over by an unfinished publish of %s", store.uri(key), where.uri)
            store.delete(key)
    for entry in manifest.files:
        key = where.key(entry.name)
        if store.exists(key):
            stored = store.info(key)
            if stored.sha256 == entry.sha256 and stored.size == entry.size:
                continue  # already uploaded by an interrupted publish of the same model
        info = store.put_file(key, local_dir / entry.name)
        if info.sha256 != entry.sha256 or info.size != entry.size:
            raise ModelStoreError(f"{local_dir / entry.name} changed while it was published to {info.uri}")
    store.put_json(where.key(MANIFEST_NAME), manifest.as_dict())


def _publish_local(target: Path, local_dir: Path, manifest: ModelManifest) -> None:
    if target.resolve() == local_dir.resolve():
        _write_manifest_file(target, manifest)  # the model was written in place; only the manifest is missing
        return
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ModelStoreError(f"{target} exists, is not empty and holds no manifest; refusing to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        for entry in manifest.files:
            destination = staging / entry.name
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local_dir / entry.name, destination)
            if file_sha256(destination) != (entry.sha256, entry.size):
                raise ModelStoreError(f"{local_dir / entry.name} changed while it was copied to {target}")
        _write_manifest_file(staging, manifest)
        staging.chmod(0o755)
        os.replace(staging, target)  # rename(2) replaces an empty folder in one step
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_manifest_file(folder: Path, manifest: ModelManifest) -> None:
    temp = folder / f".{MANIFEST_NAME}.{os.getpid()}.tmp"
    temp.write_bytes(canonical_json(manifest.as_dict()))
    os.replace(temp, folder / MANIFEST_NAME)


# --- fetching -------------------------------------------------------------------------------------------------


def fetch_model(
    artifacts: ArtifactStore,
    location: str,
    dest: str | os.PathLike[str],
    *,
    include: Callable[[str], bool] | None = None,
) -> Path:
    """A local folder holding the model at `location`; returns its path.

    A local folder location is returned as it is (its manifest, when present, must match the files' sizes). A store
    location is downloaded into `dest` — only the files `include` accepts, when given — each file verified against
    the manifest; `dest/manifest.json` is written last. Files already in `dest` are kept when they match the
    manifest, so an interrupted fetch resumes; a `dest` holding files of another model is refused.
    """
    where = resolve_model_location(artifacts, location)
    if where.path is not None:
        return _local_in_place(where)
    manifest = _read_manifest(where)
    if manifest is None:
        raise ModelStoreError(f"no model is published at {where.uri} (no {MANIFEST_NAME}: missing or unfinished)")
    target = Path(dest)
    wanted = [f for f in manifest.files if include is None or include(f.name)]
    if not wanted:
        raise ModelStoreError(f"{where.uri}: no file of the model is selected for fetching")
    trusted = _local_manifest_matches(target, manifest)
    known = {f.name for f in manifest.files}
    if target.exists():
        strays = [
            p.relative_to(target).as_posix()
            for p in target.rglob("*")
            if p.is_file() and p.relative_to(target).as_posix() not in known | {MANIFEST_NAME}
        ]
        if strays:
            raise ModelStoreError(
                f"cannot fetch {where.uri} into {target}: it holds files of something else ({strays[0]})"
            )
    store = where.store
    assert store is not None
    for entry in wanted:
        path = target / entry.name
        if path.is_file():
            if trusted and path.stat().st_size == entry.size:
                continue
            if not trusted and file_sha256(path) == (entry.sha256, entry.size):
                continue
        info = store.get_file(where.key(entry.name), path)
        if (info.sha256, info.size) != (entry.sha256, entry.size):
            path.unlink(missing_ok=True)
            raise ModelStoreError(
                f"{info.uri} does not match the manifest of {where.uri} (sha256 {info.sha256[:12]}…, expected "
                f"{entry.sha256[:12]}…)"
            )
    target.mkdir(parents=True, exist_ok=True)
    _write_manifest_file(target, manifest)
    return target


def _local_manifest_matches(target: Path, manifest: ModelManifest) -> bool:
    try:
        data = json.loads((target / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(data == manifest.as_dict())


def _local_in_place(where: ModelLocation) -> Path:
    path = where.path
    assert path is not None
    if not path.is_dir() or not any(path.iterdir()):
        raise ModelStoreError(f"model folder {path} does not exist or is empty")
    manifest = _read_manifest(where)
    if manifest is not None:
        for entry in manifest.files:
            file = path / entry.name
            if not file.is_file() or file.stat().st_size != entry.size:
                raise ModelStoreError(f"model folder {path}: {entry.name} is missing or differs from its manifest")
    return path
