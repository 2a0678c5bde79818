"""Artifact store in a local folder (the embedded default profile).

Layout under the root: ``<key>`` (the bytes, browsable), ``.partial/`` (staging, published by one atomic
``os.replace``), ``.meta/`` (one SHA-256 record per published version, in sidecar files named by a hash of the key),
``.probe/`` and the marker ``.mass-ops-store``. Reads check the bytes against the record of the file being read, or
else against one of the key's recorded versions: an edit made outside the store is refused
(`ArtifactIntegrityError`), a copied folder still reads. Records of other versions are pruned after
`RECORD_GRACE_S`. Layout, integrity and why sidecar records: docs/storage.md (`mass_ops.store.local_artifacts`).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from mass_ops.store.artifacts import (
    STORE_MARKER,
    ArtifactInfo,
    ArtifactIntegrityError,
    ArtifactKeyError,
    ArtifactNotFoundError,
    ArtifactStore,
    StagingLeftover,
    VerifiedStream,
    _old_files,
    copy_and_hash,
    create_temp_file,
    fsync_directory,
    validate_key,
    validate_prefix,
)

logger = logging.getLogger(__name__)

PARTIAL_DIR = ".partial"
META_DIR = ".meta"
PROBE_DIR = ".probe"
RECORD_GRACE_S = 3600.0
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class LocalArtifactStore(ArtifactStore):
    """Artifacts as files under `root` (created if missing, unless `create` is False); see the module docstring for
    layout and atomicity."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        self._root = Path(root).expanduser().resolve()
        if not create:
            return  # inspect only: nothing is made in a folder that may not be a store at all
        try:
            for folder in (self._root, self._root / PARTIAL_DIR, self._root / META_DIR):
                folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._unavailable("opening the folder", self.url, exc) from exc

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

    def _records_dir(self, key: str) -> Path:
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        return self._root / META_DIR / digest[:2] / digest

    def _legacy_record_path(self, key: str) -> Path:
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        return self._root / META_DIR / digest[:2] / f"{digest}.json"

    def _staging_dir(self) -> Path:
        return self._root / PARTIAL_DIR

    # --- records ---

    @staticmethod
    def _identity(stat: os.stat_result) -> dict[str, int]:
        return {"inode": stat.st_ino, "device": stat.st_dev, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}

    def _write_record(self, key: str, sha256: str, stat: os.stat_result) -> None:
        """Record `sha256` as a version of `key`, naming the file `stat` describes (replaces that version's record)."""
        record = {"key": key, "sha256": sha256, **self._identity(stat)}
        path = self._records_dir(key) / f"{sha256}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = create_temp_file(self._root / PARTIAL_DIR, "record-")
        except OSError as exc:
            raise self._unavailable(f"recording the SHA-256 of {key!r}", self.url, exc) from exc
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(record, out, sort_keys=True)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, path)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            raise self._unavailable(f"recording the SHA-256 of {key!r}", self.url, exc) from exc
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def _record_files(self, key: str) -> list[Path]:
        folder = self._records_dir(key)
        try:
            files = [entry for entry in folder.iterdir() if entry.suffix == ".json"]
        except (FileNotFoundError, NotADirectoryError):
            files = []
        legacy = self._legacy_record_path(key)
        return [*files, legacy] if legacy.is_file() else files

    def _records(self, key: str) -> list[dict[str, Any]]:
        """The readable records of `key`'s versions (unreadable or foreign ones are skipped)."""
        records = []
        for path in self._record_files(key):
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(record, dict) and record.get("key") == key and _SHA256.match(str(record.get("sha256"))):
                records.append(record)
        return records

    def _expected_sha256(self, key: str, stat: os.stat_result) -> str | frozenset[str] | None:
        """What the bytes of the file `stat` describes must hash to.

        The hash of the record naming exactly this file; else any recorded version's hash (the file is not the one
        a record was computed from, so its bytes must prove they are a published version); None with no record.
        """
        records = self._records(key)
        if not records:
            return None
        identity = self._identity(stat)
        exact: set[str] = {
            r["sha256"] for r in records if all(r.get(name) == value for name, value in identity.items())
        }
        if len(exact) == 1:
            return exact.pop()
        return frozenset(r["sha256"] for r in records)

    def _prune_records(self, key: str, keep: str) -> None:
        """Drop records of other versions than `keep` once older than the grace period (and the legacy record)."""
        cutoff = time.time() - RECORD_GRACE_S
        for path in self._record_files(key):
            if path.name == f"{keep}.json":
                continue
            with contextlib.suppress(OSError):
                if path == self._legacy_record_path(key) or path.stat().st_mtime < cutoff:
                    path.unlink()

    # --- publishing ---

    def _publish(self, key: str, staged: Path, sha256: str, size: int) -> ArtifactInfo:
        try:
            with staged.open("rb") as handle:
                os.fsync(handle.fileno())
                stat = os.fstat(handle.fileno())
        except OSError as exc:
            raise self._unavailable(f"publishing {key!r}", self.url, exc) from exc
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
            except OSError as exc:
                raise self._unavailable(f"publishing {key!r}", self.url, exc) from exc
        fsync_directory(target.parent)
        self._prune_records(key, keep=sha256)
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
        except OSError as exc:
            raise self._unavailable("reading", path.as_uri(), exc) from exc
        return _ReadErrors(handle, lambda error: self._unavailable("reading", path.as_uri(), error))

    def _open_verified(self, key: str) -> VerifiedStream:
        handle = self._open_file(key)
        # The record is checked against the open file, so a concurrent replace cannot pair old bytes with a new hash.
        stat = os.fstat(handle.fileno())
        return VerifiedStream(
            handle, uri=self.uri(key), expected_sha256=self._expected_sha256(key, stat), expected_size=stat.st_size
        )

    def exists(self, key: str) -> bool:
        return self._data_path(validate_key(key)).is_file()

    def info(self, key: str) -> ArtifactInfo:
        with self._open_file(key) as handle:
            stat = os.fstat(handle.fileno())
            expected = self._expected_sha256(key, stat)
            if isinstance(expected, str):
                return ArtifactInfo(uri=self.uri(key), key=key, sha256=expected, size=stat.st_size)
            sha256, size = copy_and_hash(handle)
            if expected is not None and sha256 not in expected:
                raise ArtifactIntegrityError(
                    f"{self.uri(key)} does not match its recorded SHA-256 {' or '.join(sorted(expected))} "
                    f"(read {sha256}): it was changed outside the store"
                )
            # A published version under a new identity (copied folder, touched file), or a key never recorded:
            # record it, but only if the file did not change while it was hashed.
            if self._identity(os.fstat(handle.fileno())) == self._identity(stat) and size == stat.st_size:
                self._write_record(key, sha256, stat)
        return ArtifactInfo(uri=self.uri(key), key=key, sha256=sha256, size=stat.st_size)

    def list(self, prefix: str = "") -> list[str]:
        prefix = validate_prefix(prefix)
        start_rel = prefix.rpartition("/")[0]
        keys: list[str] = []
        start = self._root / start_rel if start_rel else self._root
        failures: list[OSError] = []
        # os.walk skips folders it cannot read unless told otherwise: a listing must not silently miss artifacts.
        for dirpath, dirnames, filenames in os.walk(start, onerror=failures.append):
            relative = Path(dirpath).relative_to(self._root).as_posix()
            relative = "" if relative == "." else relative
            if not relative:
                dirnames[:] = [
                    name for name in dirnames if name not in (PARTIAL_DIR, META_DIR, PROBE_DIR, STORE_MARKER)
                ]
            # Descend only into folders that can hold keys with this prefix.
            dirnames[:] = sorted(
                name
                for name in dirnames
                if f"{relative}/{name}/".lstrip("/").startswith(prefix)
                or prefix.startswith(f"{relative}/{name}/".lstrip("/"))
            )
            for name in filenames:
                if not relative and name in (PARTIAL_DIR, META_DIR, PROBE_DIR, STORE_MARKER):
                    continue  # the store's own names, even when something replaced its folder by a file
                key = f"{relative}/{name}" if relative else name
                if key.startswith(prefix):
                    keys.append(key)
        unreadable = [exc for exc in failures if not isinstance(exc, FileNotFoundError | NotADirectoryError)]
        if unreadable:
            raise self._unavailable(f"listing {prefix!r}", self.url, unreadable[0])
        return sorted(keys)

    def age_s(self, key: str) -> float:
        path = self._data_path(validate_key(key))
        try:
            return time.time() - path.stat().st_mtime
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise ArtifactNotFoundError(f"artifact {path.as_uri()} does not exist") from exc

    def staging_leftovers(self, older_than_s: float) -> builtins.list[StagingLeftover]:
        """Old files in ``.partial/`` and ``.probe/``, and record folders of keys that hold no artifact."""
        found = super().staging_leftovers(older_than_s) + _old_files(
            self._root / PROBE_DIR, "probe object", older_than_s
        )
        now = time.time()
        meta = self._root / META_DIR
        for records in sorted(meta.glob("??/*")):
            try:
                newest = max((entry.stat().st_mtime for entry in records.iterdir()), default=records.stat().st_mtime)
                record = json.loads(next(iter(sorted(records.glob("*.json")))).read_text(encoding="utf-8"))
            except (OSError, ValueError, StopIteration):
                continue
            key = record.get("key") if isinstance(record, dict) else None
            if not isinstance(key, str) or not records.is_dir() or now - newest <= older_than_s:
                continue
            if self._records_dir(key) == records and not self._data_path(key).is_file():
                found.append(
                    StagingLeftover(
                        "orphan record",
                        str(records),
                        None,
                        now - newest,
                        functools.partial(shutil.rmtree, records, ignore_errors=True),
                    )
                )
        return found

    def delete(self, key: str) -> None:
        path = self._data_path(validate_key(key))
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            pass
        except OSError as exc:
            raise self._unavailable("deleting", path.as_uri(), exc) from exc
        shutil.rmtree(self._records_dir(key), ignore_errors=True)
        self._legacy_record_path(key).unlink(missing_ok=True)
        # Prune folders the delete left empty, so the name can later hold an artifact again.
        for parent in path.parents:
            if parent == self._root or not parent.is_relative_to(self._root):
                break
            try:
                parent.rmdir()
            except OSError:
                break


class _ReadErrors:
    """Raw file wrapper whose read `OSError`s (an I/O error, a vanished network mount) become the store's error."""

    def __init__(self, handle: BinaryIO, wrap: Callable[[OSError], BaseException]) -> None:
        self._handle = handle
        self._wrap = wrap

    def read(self, size: int = -1) -> bytes:
        try:
            return self._handle.read(size)
        except OSError as exc:
            raise self._wrap(exc) from exc

    def fileno(self) -> int:
        return self._handle.fileno()

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> _ReadErrors:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
