"""Artifact store in a local folder (the embedded default profile).

Layout under the root:

- ``<key>``: the artifact's bytes, so the folder can be browsed and copied with ordinary tools.
- ``.partial/``: staging files of puts in progress. Publishing is one ``os.replace`` from here to ``<key>`` (same
  filesystem, so the rename is atomic): a reader sees the old file or the new one, never a half-written one, and
  `list` never looks in here. A crashed put leaves only an orphan staging file.
- ``.meta/<h[:2]>/<h>.json`` with ``h = sha256(key)``: the record of the artifact's SHA-256 and size.

Why a sidecar record and not extended attributes: xattrs are dropped by many copy tools, archives and network
filesystems. Naming the record by a hash of the key keeps it out of the key namespace (no key can collide with it).
The record is written before the data rename and names the inode, device, size and mtime of the staged file, which
the rename preserves; a record that does not match the file currently under the key (a put between the two renames,
a crash, a folder copied elsewhere, an edit made outside the store) is ignored and the hash recomputed from the
bytes, then recorded again. So the data rename alone decides what is published, and a record never vouches for
bytes it was not computed from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from mass_ops.store.artifacts import (
    ArtifactInfo,
    ArtifactIntegrityError,
    ArtifactKeyError,
    ArtifactNotFoundError,
    ArtifactStore,
    ArtifactStoreConfigError,
    VerifiedStream,
    copy_and_hash,
    create_temp_file,
    fsync_directory,
    validate_key,
    validate_prefix,
)

logger = logging.getLogger(__name__)

PARTIAL_DIR = ".partial"
META_DIR = ".meta"


class LocalArtifactStore(ArtifactStore):
    """Artifacts as files under `root` (created if missing); see the module docstring for layout and atomicity."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._root = Path(root).expanduser().resolve()
        try:
            for folder in (self._root, self._root / PARTIAL_DIR, self._root / META_DIR):
                folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ArtifactStoreConfigError(
                f"cannot use {self._root} as an artifact folder: {exc.strerror or exc}"
            ) from exc

    @property
    def root(self) -> Path:
        """The folder holding the artifacts."""
        return self._root

    @property
    def url(self) -> str:
        return self._root.as_uri()

    def uri(self, key: str) -> str:
        return self._data_path(validate_key(key)).as_uri()

    def _data_path(self, key: str) -> Path:
        return self._root / key

    def _record_path(self, key: str) -> Path:
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        return self._root / META_DIR / digest[:2] / f"{digest}.json"

    def _staging_dir(self) -> Path:
        return self._root / PARTIAL_DIR

    # --- records ---

    @staticmethod
    def _identity(stat: os.stat_result) -> dict[str, int]:
        return {"inode": stat.st_ino, "device": stat.st_dev, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}

    def _write_record(self, key: str, sha256: str, stat: os.stat_result) -> None:
        record = {"key": key, "sha256": sha256, **self._identity(stat)}
        path = self._record_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = create_temp_file(self._root / PARTIAL_DIR, "record-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(record, out, sort_keys=True)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def _recorded_sha256(self, key: str, stat: os.stat_result) -> str | None:
        """The recorded SHA-256 if the record describes exactly the file `stat` was taken from."""
        try:
            record: dict[str, Any] = json.loads(self._record_path(key).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if record.get("key") != key or any(record.get(name) != value for name, value in self._identity(stat).items()):
            return None
        sha256 = record.get("sha256")
        return sha256 if isinstance(sha256, str) else None

    # --- publishing ---

    def _publish(self, key: str, staged: Path, sha256: str, size: int) -> ArtifactInfo:
        with staged.open("rb") as handle:
            os.fsync(handle.fileno())
            stat = os.fstat(handle.fileno())
        if stat.st_size != size:
            raise ArtifactIntegrityError(f"staged bytes for {key!r} changed size before publishing")
        self._write_record(key, sha256, stat)
        target = self._data_path(key)
        for attempt in range(3):
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staged, target)
                break
            except FileNotFoundError:
                # A concurrent delete pruned the (empty) parent between mkdir and rename: make it again.
                if attempt == 2:
                    raise
            except (FileExistsError, NotADirectoryError) as exc:
                raise ArtifactKeyError(
                    f"cannot store {key!r} in {self._root}: a parent of it is already an artifact, not a folder"
                ) from exc
            except IsADirectoryError as exc:
                raise ArtifactKeyError(
                    f"cannot store {key!r} in {self._root}: it is already a folder of other artifacts"
                ) from exc
        fsync_directory(target.parent)
        info = ArtifactInfo(uri=target.as_uri(), key=key, sha256=sha256, size=size)
        logger.debug("stored %s (%d bytes, sha256 %s)", info.uri, size, sha256)
        return info

    # --- reading ---

    def _open_file(self, key: str) -> Any:
        path = self._data_path(validate_key(key))
        try:
            handle = path.open("rb", buffering=0)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise ArtifactNotFoundError(f"artifact {path.as_uri()} does not exist") from exc
        return handle

    def _open_verified(self, key: str) -> VerifiedStream:
        handle = self._open_file(key)
        # The record is checked against the open file, so a concurrent replace cannot pair old bytes with a new hash.
        stat = os.fstat(handle.fileno())
        return VerifiedStream(
            handle, uri=self.uri(key), expected_sha256=self._recorded_sha256(key, stat), expected_size=stat.st_size
        )

    def exists(self, key: str) -> bool:
        return self._data_path(validate_key(key)).is_file()

    def info(self, key: str) -> ArtifactInfo:
        with self._open_file(key) as handle:
            stat = os.fstat(handle.fileno())
            sha256 = self._recorded_sha256(key, stat)
            if sha256 is None:
                sha256, size = copy_and_hash(handle)
                # Record only if the file did not change while it was hashed.
                if self._identity(os.fstat(handle.fileno())) == self._identity(stat) and size == stat.st_size:
                    self._write_record(key, sha256, stat)
        return ArtifactInfo(uri=self.uri(key), key=key, sha256=sha256, size=stat.st_size)

    def list(self, prefix: str = "") -> list[str]:
        prefix = validate_prefix(prefix)
        start_rel = prefix.rpartition("/")[0]
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(self._root / start_rel if start_rel else self._root):
            relative = Path(dirpath).relative_to(self._root).as_posix()
            relative = "" if relative == "." else relative
            if not relative:
                dirnames[:] = [name for name in dirnames if name not in (PARTIAL_DIR, META_DIR)]
            # Descend only into folders that can hold keys with this prefix.
            dirnames[:] = sorted(
                name
                for name in dirnames
                if f"{relative}/{name}/".lstrip("/").startswith(prefix)
                or prefix.startswith(f"{relative}/{name}/".lstrip("/"))
            )
            for name in filenames:
                key = f"{relative}/{name}" if relative else name
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._data_path(validate_key(key))
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, IsADirectoryError):
            path.unlink()
        self._record_path(key).unlink(missing_ok=True)
        # Prune folders the delete left empty, so the name can later hold an artifact again.
        for parent in path.parents:
            if parent == self._root or not parent.is_relative_to(self._root):
                break
            try:
                parent.rmdir()
            except OSError:
                break
