"""Artifact store: immutable blobs by key, on S3 or in a local folder, behind one interface.

Contract shared by every backend: keys are relative POSIX paths (`validate_key`) mapped to URIs under the root;
every put returns an `ArtifactInfo` with the SHA-256 of the streamed bytes, and reads verify it
(`ArtifactIntegrityError`); an unreachable store raises `ArtifactUnavailableError`; publishing is atomic; `put_dir`
stores a deterministic ``tar.gz`` and `get_dir` extracts it safely within the archive limits; `probe()` checks the
store and writes its marker ``.mass-ops-store`` (or `mark()`), which bulk deletion requires.
`mass_ops.store.artifact_backends.open_artifact_store(url)` opens a store; this module imports no backend.
The contract in full: docs/storage.md (`mass_ops.store.artifacts`).
"""

from __future__ import annotations

import builtins
import contextvars
import functools
import gzip
import hashlib
import io
import json
import logging
import os
import secrets
import shutil
import tarfile
import tempfile
import time
import unicodedata
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol, cast
from urllib.parse import unquote

from mass_ops.errors import InfrastructureError, InputError
from mass_ops.store.errors import StorageError, storage_error
from mass_ops.store.untrusted import (
    ARCHIVE_LIMITS,
    JSON_MAX_BYTES,
    ArchiveLimits,
    ArchiveTooLargeError,
    UnsafeArchiveInputError,
    UntrustedInputError,
    extract_tar_gz,
    is_within,
    loads_untrusted,
)

logger = logging.getLogger(__name__)

CHUNK_SIZE = 1024 * 1024
MAX_KEY_BYTES = 1024  # S3's limit on the length of an object key
MAX_SEGMENT_BYTES = 255  # NAME_MAX of the usual local filesystems
STORE = "artifact store"
PROBE_DIR = ".probe"  # probe objects of `ArtifactStore.probe`; stale ones are removed by `mass_ops.store.gc`
STORE_MARKER = ".mass-ops-store"  # the object that says "this location is a mass-ops artifact store" (see `mark`)
# Top-level names the stores keep for themselves; refused on every backend so a key works on both.
RESERVED_TOP_LEVEL = frozenset({".partial", ".meta", PROBE_DIR, STORE_MARKER})
# Set only inside `ArtifactStore.probe`: lets the store's own calls use keys under PROBE_DIR.
_PROBE_KEYS_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar("mass_ops_probe_keys", default=False)
# Set only inside `ArtifactStore.is_marked`/`mark`: lets the store's own calls use the key STORE_MARKER.
_MARKER_KEY_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar("mass_ops_marker_key", default=False)


class ArtifactError(Exception):
    """Base class of every artifact store failure."""


class ArtifactKeyError(ArtifactError, InputError):
    """A key or prefix breaks the key rules, or cannot be stored under this backend's layout."""


class ArtifactNotFoundError(ArtifactError, FileNotFoundError):
    """No artifact is stored under the key."""


class ArtifactIntegrityError(ArtifactError, InfrastructureError):
    """Stored bytes do not match their recorded SHA-256 or size (edited, truncated or rotted in place)."""


class ArtifactUnavailableError(ArtifactError, StorageError):
    """The store did not answer in time, refused the request, or could not be written (one line, exit 1)."""


class ArtifactFormatError(ArtifactError, InputError):
    """Content is not what the call expects: invalid JSON, not a tar.gz, a value that JSON cannot hold."""


class UnsafeArchiveError(ArtifactFormatError):
    """A tarball has a member or link that would land outside the extraction folder, or a device/FIFO member."""


class ArchiveTooLargeArtifactError(UnsafeArchiveError):
    """A tarball would unpack to more than its `ArchiveLimits` (members, bytes, bytes per archive byte)."""


class ArtifactSourceError(ArtifactError, InputError):
    """The local input of a put (file, folder, stream) is missing, of the wrong kind, or changed while read."""


class ArtifactStoreConfigError(ArtifactError, InputError):
    """The store URL or a store setting is invalid."""


@dataclass(frozen=True)
class ArtifactInfo:
    """A stored artifact: its URI, key within the store, SHA-256 (hex) and size of the stored bytes."""

    uri: str
    key: str
    sha256: str
    size: int


@dataclass(frozen=True)
class StagingLeftover:
    """Something a put or probe left behind that no reader will ever see (found by `ArtifactStore.staging_leftovers`).

    `kind`: "staging file", "multipart upload", "probe object" or "orphan record"; `location`: its path or URI;
    `size` in bytes when known; `age_s` since it was last written; `remove()` deletes it (missing is fine).
    """

    kind: str
    location: str
    size: int | None
    age_s: float
    remove: Callable[[], None] = field(repr=False, compare=False)


class ReadableStream(Protocol):
    """Anything with a binary ``read(size)``: an open file, a socket file, a response body."""

    def read(self, size: int = -1, /) -> bytes: ...


# --- keys -------------------------------------------------------------------------------------------------------


def key_problem(path: object) -> str | None:
    """Why `path` is not a usable key or prefix body, or None when it is."""
    if not isinstance(path, str):
        return f"must be a string, not {type(path).__name__}"
    if not path:
        return "is empty"
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode text (lone surrogate)"
    if "\\" in path:
        return "contains a backslash; keys separate folders with '/'"
    control = next((char for char in path if unicodedata.category(char) == "Cc"), None)
    if control is not None:
        return f"contains the control character {control!r}"
    if path.startswith("/"):
        return "is absolute; keys are relative to the store root"
    if len(encoded) > MAX_KEY_BYTES:
        return f"is {len(encoded)} bytes long in UTF-8; the limit is {MAX_KEY_BYTES}"
    for segment in path.split("/"):
        if segment == "":
            return "has an empty path segment ('//' or a trailing '/')"
        if segment in (".", ".."):
            return f"has a {segment!r} segment"
        if len(segment.encode("utf-8")) > MAX_SEGMENT_BYTES:
            return f"has a segment longer than {MAX_SEGMENT_BYTES} bytes"
    return None


def validate_key(key: object) -> str:
    """Return `key` if it is a valid artifact key, else raise `ArtifactKeyError` saying why."""
    problem = key_problem(key)
    if (
        problem is None
        and isinstance(key, str)
        and key.split("/", 1)[0] in RESERVED_TOP_LEVEL
        and not (key.startswith(f"{PROBE_DIR}/") and _PROBE_KEYS_ALLOWED.get())
        and not (key == STORE_MARKER and _MARKER_KEY_ALLOWED.get())
    ):
        problem = f"starts with a reserved name ({', '.join(sorted(RESERVED_TOP_LEVEL))})"
    if problem is not None or not isinstance(key, str):
        raise ArtifactKeyError(f"invalid artifact key {key!r}: {problem}")
    return key


def validate_prefix(prefix: object) -> str:
    """Return `prefix` if it is a valid listing prefix ("" or a key start, optionally ending in '/')."""
    if prefix == "":
        return ""
    body = prefix[:-1] if isinstance(prefix, str) and prefix.endswith("/") else prefix
    problem = key_problem(body)
    if problem is not None or not isinstance(prefix, str):
        raise ArtifactKeyError(f"invalid artifact prefix {prefix!r}: {problem}")
    return prefix


# --- bytes, hashing and JSON ------------------------------------------------------------------------------------


def canonical_json(value: Any) -> bytes:
    """UTF-8 JSON with sorted keys and no insignificant whitespace: equal values give equal bytes.

    Raises TypeError or ValueError (NaN, infinity, unserialisable objects) from `json.dumps`.
    """
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


def copy_and_hash(source: ReadableStream, target: BinaryIO | None = None) -> tuple[str, int]:
    """Stream `source` to its end (into `target` when given); return (SHA-256 hex, byte count)."""
    digest = hashlib.sha256()
    size = 0
    while True:
        chunk = source.read(CHUNK_SIZE)
        if not chunk:
            break
        if not isinstance(chunk, bytes | bytearray | memoryview):
            raise ArtifactSourceError(
                f"artifact sources must be binary streams; read() returned {type(chunk).__name__}"
            )
        digest.update(chunk)
        if target is not None:
            target.write(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def copy_stream(source: ReadableStream, target: BinaryIO) -> None:
    """Copy `source` to `target` in large chunks until EOF."""
    while chunk := source.read(CHUNK_SIZE):
        target.write(chunk)


def file_sha256(path: Path) -> tuple[str, int]:
    """SHA-256 hex and size of a local file, read in chunks."""
    with path.open("rb") as handle:
        return copy_and_hash(handle)


class _HashingWriter:
    """Write-through wrapper that hashes everything written (the tarball builder writes into it)."""

    def __init__(self, target: BinaryIO) -> None:
        self._target = target
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self._target.write(view)
        self._digest.update(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._target.flush()

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()


class VerifiedStream(io.RawIOBase):
    """Raw read stream over stored bytes that checks size and SHA-256 when the end of the data is reached.

    `expected_sha256` is the store's record: one hash, a collection of acceptable hashes (the local store's recent
    versions of a key), or None (no record; the digest is still computed and available as `sha256` once the stream
    is exhausted). `require` adds a hash the bytes must equal besides (the one a metadata row recorded). A consumer
    that stops early gets no check.
    """

    def __init__(
        self,
        source: Any,
        *,
        uri: str,
        expected_sha256: str | Collection[str] | None,
        expected_size: int | None,
    ) -> None:
        super().__init__()
        self._source = source
        self._uri = uri
        self._expected_sha256: frozenset[str] | None = (
            None
            if expected_sha256 is None
            else frozenset([expected_sha256] if isinstance(expected_sha256, str) else expected_sha256)
        )
        self._required_sha256: str | None = None
        self._expected_size = expected_size
        self._digest = hashlib.sha256()
        self._size = 0
        self._finished = False

    def require(self, sha256: str | None) -> VerifiedStream:
        """Also demand that the bytes hash to `sha256` (no-op for None); returns the stream."""
        if sha256 is not None:
            self._required_sha256 = sha256.lower()
        return self

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._source.read(len(view))
        count = len(data)
        if count == 0:
            self._finish()
            return 0
        view[:count] = data
        self._digest.update(data)
        self._size += count
        if self._expected_size is not None and self._size > self._expected_size:
            raise ArtifactIntegrityError(f"{self._uri} is longer than its recorded {self._expected_size} bytes")
        return count

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self._expected_size is not None and self._size != self._expected_size:
            raise ArtifactIntegrityError(
                f"{self._uri} ended after {self._size} of its recorded {self._expected_size} bytes"
            )
        actual = self._digest.hexdigest()
        if self._expected_sha256 is not None and actual not in self._expected_sha256:
            recorded = " or ".join(sorted(self._expected_sha256))
            raise ArtifactIntegrityError(
                f"{self._uri} does not match its recorded SHA-256 {recorded} (read {actual}): "
                "it was changed outside the store"
            )
        if self._required_sha256 is not None and actual != self._required_sha256:
            raise ArtifactIntegrityError(
                f"{self._uri} does not match its recorded SHA-256 {self._required_sha256} in the metadata store "
                f"(read {actual})"
            )

    @property
    def sha256(self) -> str:
        """SHA-256 of everything read; only meaningful once the stream is exhausted."""
        return self._digest.hexdigest()

    @property
    def size(self) -> int:
        return self._size

    def close(self) -> None:
        if not self.closed:
            try:
                self._source.close()
            finally:
                super().close()


# --- local files written atomically -----------------------------------------------------------------------------


def create_temp_file(directory: Path, prefix: str) -> tuple[int, Path]:
    """Create a new empty file with a random name in `directory`; return (open write fd, path).

    Unlike `tempfile.mkstemp` the mode follows the umask (0o666 & ~umask), so a published file gets the same
    permissions as one written in place.
    """
    while True:
        path = directory / f"{prefix}{secrets.token_hex(8)}.partial"
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), path
        except FileExistsError:
            continue


def fsync_directory(directory: Path) -> None:
    """Make a rename inside `directory` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- deterministic tarballs -------------------------------------------------------------------------------------


def _walk_sorted(root: Path, relative: str = "") -> Iterator[str]:
    """Relative POSIX paths under `root`, parents before children, names in sorted order; symlinks not followed."""
    with os.scandir(root / relative if relative else root) as scan:
        entries = sorted(scan, key=lambda entry: entry.name)
    for entry in entries:
        path = f"{relative}/{entry.name}" if relative else entry.name
        yield path
        if entry.is_dir(follow_symlinks=False):
            yield from _walk_sorted(root, path)


def write_tarball(directory: Path, target: Any, *, skip_escaping_links: bool = False) -> None:
    """Write `directory` as a deterministic tar.gz into the binary file-like `target`.

    Entries are sorted; mtimes are 0, owners 0/0 without names, modes normalised (folders 0755, files 0644 or 0755
    when executable), and the gzip header carries no name or time, so the same tree gives the same bytes (with the
    same zlib). Symlinks are kept as links; one pointing outside the folder raises `ArtifactSourceError` unless
    `skip_escaping_links` leaves it out. Sockets, FIFOs and devices are left out with a warning.
    """
    if not directory.is_dir():
        raise ArtifactSourceError(f"cannot archive {directory}: not a folder")
    real_root = os.path.realpath(directory)
    with (
        gzip.GzipFile(filename="", mode="wb", fileobj=target, mtime=0, compresslevel=6) as compressed,
        tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for relative in _walk_sorted(directory):
            full = directory / relative
            member = tar.gettarinfo(str(full), arcname=relative)
            if member is None or not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
                logger.warning("archive of %s leaves out %r: not a file, folder or link", directory, relative)
                continue
            if member.issym():
                link = member.linkname
                escapes = os.path.isabs(link) or not is_within(os.path.realpath(full), real_root)
                if escapes and skip_escaping_links:
                    logger.warning(
                        "archive of %s leaves out link %r -> %r: it points outside", directory, relative, link
                    )
                    continue
                if escapes:
                    raise ArtifactSourceError(
                        f"cannot archive {directory}: link {relative!r} points outside the folder ({link!r}); "
                        "pass skip_escaping_links=True to leave such links out"
                    )
            member.mtime = 0
            member.uid = member.gid = 0
            member.uname = member.gname = ""
            if member.isdir():
                member.mode = 0o755
            elif member.issym():
                member.mode = 0o777
            else:
                member.mode = 0o755 if member.mode & 0o111 else 0o644
            if member.isreg():
                with full.open("rb") as content:
                    tar.addfile(member, content)
            else:
                tar.addfile(member)


def extract_tarball(archive: Path, destination: Path, *, uri: str, limits: ArchiveLimits = ARCHIVE_LIMITS) -> int:
    """Extract the tar.gz `archive` into the new folder `destination` within `limits`, refusing unsafe members;
    returns the number of members. The checks are `store.untrusted.extract_tar_gz`'s (one extractor for every
    archive); here its errors become artifact errors: `ArchiveTooLargeArtifactError` over the limits,
    `UnsafeArchiveError` for anything else about the archive. The caller extracts into a scratch folder and
    discards it on error.
    """
    try:
        return extract_tar_gz(archive, destination, what=uri, limits=limits)
    except ArchiveTooLargeError as exc:
        raise ArchiveTooLargeArtifactError(str(exc)) from None
    except UnsafeArchiveInputError as exc:
        raise UnsafeArchiveError(str(exc)) from None


# --- the interface ----------------------------------------------------------------------------------------------


class ArtifactStore(ABC):
    """Put and get artifacts by key; see the module docstring for the contract.

    Backends implement the read side (`_open_verified`, `exists`, `list`, `info`, `delete`) and `_publish`, which
    makes a fully written staging file visible under a key in one atomic step. Every put stages its bytes first
    (hashing them on the way), so all puts share one atomicity argument.
    """

    @property
    @abstractmethod
    def url(self) -> str:
        """URL of the store root (``s3://bucket/prefix`` or ``file:///path``); never carries credentials."""

    @abstractmethod
    def uri(self, key: str) -> str:
        """URI of the artifact stored under `key`."""

    def key_of(self, uri: str) -> str:
        """The key whose URI is `uri` (the inverse of `uri`, percent-encoded or not); ArtifactKeyError when `uri`
        lies outside this store. Rows hold URIs; reading one back goes through here."""
        base = self.url.rstrip("/") + "/"
        if uri.startswith(base):
            relative = uri[len(base) :]
            for key in (unquote(relative), relative):
                try:
                    if self.uri(key) == uri:
                        return key
                except ValueError:
                    continue
        raise ArtifactKeyError(f"{uri} is not an artifact of the configured store {self.url}")

    @abstractmethod
    def _open_verified(self, key: str) -> VerifiedStream:
        """Open the artifact's bytes with its recorded SHA-256/size; `ArtifactNotFoundError` if absent."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a complete artifact is stored under `key`."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys that start with `prefix` (a plain string prefix, as on S3); partial uploads never show."""

    @abstractmethod
    def info(self, key: str) -> ArtifactInfo:
        """URI, SHA-256 and size of a stored artifact (the hash is recomputed if no valid record exists)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the artifact; deleting a missing key is not an error."""

    @abstractmethod
    def _publish(self, key: str, staged: Path, sha256: str, size: int) -> ArtifactInfo:
        """Make the complete file `staged` visible under `key` atomically. May move or consume `staged`."""

    def _staging_dir(self) -> Path:
        """Where puts build their bytes before publishing (a folder of the store's own, so `gc` can sweep it)."""
        return default_staging_dir()

    def _unavailable(self, action: str, target: str, cause: BaseException | str) -> ArtifactUnavailableError:
        """The one-line error for a store that could not do `action` on `target` (a key's URI or the store URL)."""
        error = storage_error(action, STORE, target, cause)
        return ArtifactUnavailableError(str(error))

    @contextmanager
    def _staging_file(self, key: str) -> Iterator[Path]:
        directory = self._staging_dir()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, path = create_temp_file(directory, "put-")
        except OSError as exc:
            raise self._unavailable(f"staging {key!r} in {directory}", self.url, exc) from exc
        os.close(fd)
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)

    @contextmanager
    def _staging_writer(self, key: str, staged: Path) -> Iterator[_StagingWriter]:
        """`staged` open for writing; a failed write (disk full, read-only) is `ArtifactUnavailableError`."""
        try:
            handle = staged.open("wb")
        except OSError as exc:
            raise self._unavailable(f"staging {key!r}", self.url, exc) from exc
        with handle:
            writer = _StagingWriter(handle, lambda exc: self._unavailable(f"staging {key!r}", self.url, exc))
            yield writer
            writer.flush()

    # --- writing ---

    def put_stream(self, key: str, stream: ReadableStream) -> ArtifactInfo:
        """Store everything `stream` yields until EOF. If reading fails midway, nothing becomes visible."""
        key = validate_key(key)
        with self._staging_file(key) as staged:
            with self._staging_writer(key, staged) as out:
                sha256, size = copy_and_hash(stream, cast(BinaryIO, out))
            return self._publish(key, staged, sha256, size)

    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> ArtifactInfo:
        """Store `data` under `key`."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ArtifactSourceError(
                f"put_bytes of {key!r} needs bytes, got {type(data).__name__}; use put_json or encode the text"
            )
        return self.put_stream(key, io.BytesIO(data))

    def put_json(self, key: str, value: Any) -> ArtifactInfo:
        """Store `value` as canonical JSON (sorted keys, compact, UTF-8)."""
        key = validate_key(key)
        try:
            data = canonical_json(value)
        except (TypeError, ValueError) as exc:
            raise ArtifactFormatError(f"cannot store {key!r} as JSON: {exc}") from exc
        return self.put_bytes(key, data)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> ArtifactInfo:
        """Store the content of the local file `path`, streamed (multipart on S3 above the threshold)."""
        key = validate_key(key)
        source = require_source_file(path, key)
        with source.open("rb") as handle:
            return self.put_stream(key, handle)

    def put_dir(
        self, key: str, directory: str | os.PathLike[str], *, skip_escaping_links: bool = False
    ) -> ArtifactInfo:
        """Store the folder `directory` as a deterministic tar.gz (see `write_tarball`)."""
        key = validate_key(key)
        with self._staging_file(key) as staged:
            with self._staging_writer(key, staged) as out:
                writer = _HashingWriter(cast(BinaryIO, out))
                write_tarball(Path(directory), writer, skip_escaping_links=skip_escaping_links)
            return self._publish(key, staged, writer.sha256, writer.size)

    # --- reading ---

    def open_read(self, key: str, *, sha256: str | None = None) -> io.BufferedReader:
        """Open the artifact for streaming reads (use as a context manager). Reading to the end verifies SHA-256
        (the store's record, and `sha256` when given)."""
        return io.BufferedReader(self._open_verified(key).require(sha256), buffer_size=CHUNK_SIZE)

    def get_bytes(self, key: str, *, sha256: str | None = None) -> bytes:
        """The artifact's bytes, verified against the recorded SHA-256 (and `sha256`, e.g. from a metadata row)."""
        buffer = io.BytesIO()
        with self._open_verified(key).require(sha256) as stream:
            copy_stream(stream, buffer)
        return buffer.getvalue()

    def get_json(self, key: str, *, sha256: str | None = None, max_bytes: int = JSON_MAX_BYTES) -> Any:
        """The artifact parsed as JSON by the platform's reader of untrusted JSON (an episode's documents come from
        its pod): `ArtifactFormatError` naming the URI if it is not JSON, nests too deep or is over `max_bytes`
        (refused before more than `max_bytes` are read)."""
        buffer = io.BytesIO()
        with self._open_verified(key).require(sha256) as stream:
            while chunk := stream.read(CHUNK_SIZE):
                buffer.write(chunk)
                if buffer.tell() > max_bytes:
                    raise ArtifactFormatError(f"{self.uri(key)} is not valid JSON: over the {max_bytes:,}-byte limit")
        try:
            return loads_untrusted(buffer.getvalue(), what=f"{self.uri(key)} is not valid JSON", max_bytes=max_bytes)
        except UntrustedInputError as exc:
            raise ArtifactFormatError(str(exc)) from None

    def get_file(self, key: str, dest: str | os.PathLike[str], *, sha256: str | None = None) -> ArtifactInfo:
        """Download to `dest` atomically (temp file beside it, then rename); `dest` is untouched on any failure,
        including bytes that do not match the recorded SHA-256 (or `sha256`)."""
        target = Path(dest)
        with self._open_verified(key).require(sha256) as stream:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = create_temp_file(target.parent, f".{target.name}.")
            try:
                with os.fdopen(fd, "wb") as out:
                    copy_stream(stream, out)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(temp, target)
            except BaseException:
                temp.unlink(missing_ok=True)
                raise
            return ArtifactInfo(uri=self.uri(key), key=key, sha256=stream.sha256, size=stream.size)

    def get_dir(self, key: str, dest_dir: str | os.PathLike[str], *, sha256: str | None = None) -> ArtifactInfo:
        """Extract a `put_dir` artifact into `dest_dir`, which must be absent or an empty folder.

        The tree appears at `dest_dir` in one rename once fully extracted and checked; unsafe archives raise
        `UnsafeArchiveError` and leave nothing behind.
        """
        target = Path(dest_dir)
        if target.is_symlink() or (target.exists() and (not target.is_dir() or any(target.iterdir()))):
            raise ArtifactSourceError(
                f"cannot extract {self.uri(key)} into {target}: it exists and is not an empty folder"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial"))
        try:
            archive = scratch / "archive.tar.gz"
            info = self.get_file(key, archive, sha256=sha256)
            tree = scratch / "tree"
            extract_tarball(archive, tree, uri=info.uri)
            if target.is_dir():
                target.rmdir()
            os.rename(tree, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return info

    # --- housekeeping ---

    def staging_leftovers(self, older_than_s: float) -> builtins.list[StagingLeftover]:
        """Staging files, unfinished uploads and probe objects not written for `older_than_s` seconds.

        The base implementation sweeps this store's staging folder (for S3: ``<tmp>/mass-ops-staging`` on this
        machine); backends add what they keep elsewhere. A live writer keeps writing (its file's mtime moves), so a
        grace period longer than the slowest put keeps it safe.
        """
        return _old_files(self._staging_dir(), "staging file", older_than_s)

    def age_s(self, key: str) -> float:
        """Seconds since the artifact under `key` was published (`ArtifactNotFoundError` if absent)."""
        raise NotImplementedError

    # --- health ---

    def probe(self) -> None:
        """Check the store is reachable and writable: put a small object under ``.probe/``, read it back (verified),
        delete it. Raises `ArtifactUnavailableError` (one line) or `ArtifactIntegrityError`; returns None when fine.
        """
        token = secrets.token_hex(8)
        key = f"{PROBE_DIR}/{token}"
        payload = f"mass-ops probe {token}\n".encode()
        allowed = _PROBE_KEYS_ALLOWED.set(True)
        try:
            self.put_bytes(key, payload)
            try:
                if self.get_bytes(key) != payload:
                    raise ArtifactIntegrityError(f"{self.uri(key)} read back other bytes than the probe wrote")
            finally:
                self.delete(key)
        except ArtifactNotFoundError as exc:
            # Written, then not there: an eventually consistent or misbehaving endpoint.
            raise self._unavailable("probe read-back", self.url, exc) from exc
        finally:
            _PROBE_KEYS_ALLOWED.reset(allowed)
        self.mark()  # a store mass-ops has written to (validate probes it first) is a mass-ops store

    # --- the store's own marker ---

    def is_marked(self) -> bool:
        """Whether this location carries the mass-ops store marker (`STORE_MARKER` at its root)."""
        allowed = _MARKER_KEY_ALLOWED.set(True)
        try:
            return self.exists(STORE_MARKER)
        finally:
            _MARKER_KEY_ALLOWED.reset(allowed)

    def mark(self) -> bool:
        """Write the store marker unless it is there; whether it was written now. Idempotent, safe to race (the
        marker's bytes do not depend on who writes them)."""
        if self.is_marked():
            return False
        allowed = _MARKER_KEY_ALLOWED.set(True)
        try:
            self.put_json(STORE_MARKER, {"kind": "mass-ops artifact store", "format": 1})
        finally:
            _MARKER_KEY_ALLOWED.reset(allowed)
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    __str__ = __repr__


class _StagingWriter:
    """Write-only file wrapper whose `OSError`s (disk full, read-only folder) become the store's error."""

    def __init__(self, target: BinaryIO, wrap: Any) -> None:
        self._target = target
        self._wrap = wrap

    def write(self, data: Any) -> int:
        try:
            return self._target.write(data)
        except OSError as exc:
            raise self._wrap(exc) from exc

    def flush(self) -> None:
        try:
            self._target.flush()
        except OSError as exc:
            raise self._wrap(exc) from exc


def _old_files(directory: Path, kind: str, older_than_s: float) -> list[StagingLeftover]:
    """Regular files directly in `directory` last modified more than `older_than_s` seconds ago."""
    now = time.time()
    found = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        try:
            stat = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # published or removed meanwhile
        age = now - stat.st_mtime
        if entry.is_file(follow_symlinks=False) and age > older_than_s:
            path = Path(entry.path)
            found.append(
                StagingLeftover(kind, str(path), stat.st_size, age, functools.partial(path.unlink, missing_ok=True))
            )
    return sorted(found, key=lambda leftover: leftover.location)


STAGING_DIR_NAME = "mass-ops-staging"


def default_staging_dir() -> Path:
    """Where stores without a staging folder of their own (S3) build uploads: ``<tmp>/mass-ops-staging``."""
    return Path(tempfile.gettempdir()) / STAGING_DIR_NAME


def require_source_file(path: str | os.PathLike[str], key: str) -> Path:
    source = Path(path)
    if not source.is_file():
        state = "does not exist" if not source.exists() else "is not a regular file"
        raise ArtifactSourceError(f"cannot store {source} as {key!r}: it {state}")
    return source
