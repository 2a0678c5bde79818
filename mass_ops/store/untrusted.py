"""Bounded reading of bytes the platform does not trust: what an agent wrote, what a user handed in.

One place for the rules, so every reader holds the same line:
- JSON (`loads_untrusted`): a size cap checked before decoding, strict UTF-8, a nesting cap, and every way the parser
  can fail (`ValueError`, `RecursionError`, bad encoding) turned into one `UntrustedInputError` naming what was read.
- Files (`open_beneath`, `read_beneath`): opened once, below a trusted folder, one path component at a time without
  following a link anywhere (`O_NOFOLLOW`), then checked on the descriptor itself — a regular file with one link —
  and read from that descriptor. A name swapped for a link after any earlier check cannot redirect the read, and a
  hard link made into the folder from outside is refused.
- Large files (`read_capped`): at most a head and a tail of a file, sized from the descriptor before reading, so a
  500 MB report costs what its excerpt shows, not its size.
- Archives (`extract_tar_gz`): every tar.gz the platform unpacks, within one set of `ArchiveLimits` (members, bytes,
  bytes per archive byte), each member checked as its header is read, so a bomb costs its headers, not a disk.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import json
import os
import posixpath
import stat
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mass_ops.errors import InfrastructureError, InputError

JSON_MAX_BYTES = 64 << 20  # a default cap for one JSON document (request bodies and logs set their own)
JSON_MAX_DEPTH = 128  # far beyond any real config, record or model answer; far below the parser's own stack
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO must not hang the open
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECTORY


class UntrustedInputError(InputError):
    """Untrusted input that cannot be read within the rules (too big, too deep, not JSON, not a plain file)."""


def loads_untrusted(
    data: bytes | bytearray | memoryview | str,
    *,
    what: str,
    max_bytes: int = JSON_MAX_BYTES,
    max_depth: int | None = JSON_MAX_DEPTH,
) -> Any:
    """Parse one JSON document of at most `max_bytes` bytes (characters, for text) nested at most `max_depth` deep.

    `max_depth=None` leaves the nesting to the parser's own stack (still an `UntrustedInputError` past it): for hot
    paths that only pass the value on. Raises `UntrustedInputError("<what>: <why>")`; never `ValueError`,
    `RecursionError` or `UnicodeDecodeError`."""
    size = len(data)
    if size > max_bytes:
        raise UntrustedInputError(f"{what}: {size:,} bytes of JSON, over the {max_bytes:,}-byte limit")
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UntrustedInputError(f"{what}: not UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise UntrustedInputError(f"{what}: JSON nested deeper than the parser's stack") from None
    except ValueError as exc:
        raise UntrustedInputError(f"{what}: not JSON ({exc})") from None
    if max_depth is not None and json_depth(value) > max_depth:
        raise UntrustedInputError(f"{what}: JSON nested deeper than {max_depth} levels")
    return value


def json_depth(value: Any) -> int:
    """How deep `value` nests lists and objects (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children)
    return deepest


@contextlib.contextmanager
def open_beneath(root: Path | str, relative: Path | str) -> Iterator[int]:
    """A read-only descriptor of the regular file `relative` below the trusted folder `root`, closed on exit.

    Every component of `relative` is opened without following links; the file must be regular with exactly one link.
    Raises `UntrustedInputError` (FileNotFoundError when a component is missing, so callers can tell absence apart)."""
    parts = Path(relative).parts
    if not parts or Path(relative).is_absolute() or any(part in ("", ".", "..") for part in parts):
        raise UntrustedInputError(f"{relative}: not a plain relative path")
    fds: list[int] = []
    try:
        fds.append(os.open(root, _DIR_FLAGS))
        for part in parts[:-1]:
            fds.append(_open_at(fds[-1], part, _DIR_FLAGS, relative))
        fd = _open_at(fds[-1], parts[-1], _OPEN_FLAGS, relative)
        fds.append(fd)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedInputError(f"{relative}: not a regular file")
        if info.st_nlink != 1:
            raise UntrustedInputError(f"{relative}: a file with {info.st_nlink} hard links (one is expected)")
        os.set_blocking(fd, True)
        yield fd
    finally:
        for opened in reversed(fds):
            os.close(opened)


def _open_at(dir_fd: int, name: str, flags: int, relative: Path | str) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(relative)) from None
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise UntrustedInputError(f"{relative}: {name} is a link or not a folder") from None
        raise


def read_beneath(root: Path | str, relative: Path | str, *, max_bytes: int) -> bytes:
    """The bytes of `relative` below `root` (see `open_beneath`), refused when over `max_bytes`."""
    with open_beneath(root, relative) as fd:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise UntrustedInputError(f"{relative}: {size:,} bytes, over the {max_bytes:,}-byte limit")
        chunks: list[bytes] = []
        total = 0
        while chunk := os.read(fd, min(1 << 20, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # it grew while being read
                raise UntrustedInputError(f"{relative}: over the {max_bytes:,}-byte limit")
        return b"".join(chunks)


@dataclass(frozen=True)
class CappedRead:
    """What `read_capped` read of a file of `size` bytes: `head`, and `tail` when the file was larger than both."""

    head: bytes
    tail: bytes
    size: int

    @property
    def omitted(self) -> int:
        """Bytes of the file in neither `head` nor `tail` (not read)."""
        return self.size - len(self.head) - len(self.tail)


def read_capped(path: Path | str, *, head: int, tail: int = 0) -> CappedRead | None:
    """At most `head` bytes from the start and `tail` from the end of the regular file `path` — the whole file when
    it has no more than `head + tail` — whatever its size: the size is taken from the descriptor before reading.
    None when it is absent, unreadable or not a regular file (a FIFO cannot hang the open). For files below a folder
    the platform unpacked itself (links already checked to stay inside); elsewhere use `read_beneath`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        if info.st_size <= head + tail:
            return CappedRead(_pread_all(fd, head + tail, 0), b"", info.st_size)
        ending = _pread_all(fd, tail, info.st_size - tail) if tail else b""
        return CappedRead(_pread_all(fd, head, 0), ending, info.st_size)
    except OSError:
        return None
    finally:
        os.close(fd)


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    chunks: list[bytes] = []
    while size > 0 and (chunk := os.pread(fd, min(size, 1 << 20), offset)):
        chunks.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


# -- archives ------------------------------------------------------------------------------------------------------

ARCHIVE_MAX_NAME_BYTES = 64 << 20  # all member names and link targets together: what the checks keep in memory
ARCHIVE_MAX_NAME_LENGTH = 4096  # PATH_MAX: no real file has a longer name
# The most one read of the tar layer may ask for: a header, a long name, a pax record; data is copied in 16 KiB.
_ARCHIVE_MAX_READ = 1 << 20


@dataclass(frozen=True)
class ArchiveLimits:
    """What one tar.gz may unpack to: at most `max_entries` members and `max_bytes` bytes of file data, and — once
    past `ratio_floor` bytes — at most `max_ratio` bytes per byte of the archive (a gzip of zeros reaches ~1000:1,
    real workspaces 3-20:1), so a small archive cannot fill a disk that is sized for what it carries."""

    max_bytes: int = 4 << 30
    max_entries: int = 200_000
    max_ratio: float = 100.0
    ratio_floor: int = 256 << 20

    def budget(self, archive_bytes: int) -> int:
        """The most file data an archive of `archive_bytes` bytes may unpack to."""
        return min(self.max_bytes, max(self.ratio_floor, int(self.max_ratio * archive_bytes)))


# Every tar.gz the platform extracts: episode workspaces (judge, evaluation, pool), workspace seeds, stored folders.
ARCHIVE_LIMITS = ArchiveLimits()


class UnsafeArchiveInputError(UntrustedInputError):
    """A tar.gz that is not one, or has a member that could land outside the folder, a device, FIFO or sparse
    member, or an unreadable header."""


class ArchiveTooLargeError(UnsafeArchiveInputError):
    """A tar.gz over its `ArchiveLimits`: too many members, too many bytes, or too many bytes per archive byte."""


class _HeaderRefused(Exception):
    """Raised from inside tarfile's header parsing; `extract_tar_gz` names the archive in the message."""


class _BoundedTarInfo(tarfile.TarInfo):
    """Refuses sparse members while their header is parsed: tarfile reads a sparse map into memory, block after
    block, before a caller sees the member, and no archive the platform writes has one. (tarfile's own hooks: an
    archive whose sparse form these miss is still refused by `_checked_members`, after a bounded header read.)"""

    def _proc_sparse(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:
        raise _HeaderRefused(f"member {self.name[:200]!r} is a sparse file")

    def _proc_gnusparse_10(self, next: tarfile.TarInfo, pax_headers: dict[str, str], tarfile: Any) -> None:
        raise _HeaderRefused(f"member {next.name[:200]!r} is a sparse file")


class _BoundedReads(io.RawIOBase):
    """The decompressed stream as tarfile reads it, refusing any single read larger than a header could need (a long
    name or pax record is read whole into memory)."""

    def __init__(self, inner: gzip.GzipFile) -> None:
        super().__init__()
        self._inner = inner

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1, /) -> bytes:
        if size < 0 or size > _ARCHIVE_MAX_READ:
            raise _HeaderRefused(f"a header asks for {size:,} bytes at once")
        return self._inner.read(size)

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        return self._inner.seek(offset, whence)

    def tell(self) -> int:
        return self._inner.tell()


def extract_tar_gz(archive: Path, destination: Path, *, what: str, limits: ArchiveLimits = ARCHIVE_LIMITS) -> int:
    """Extract the tar.gz `archive` into the folder `destination` (created; the caller discards it on error) within
    `limits`; returns the number of members.

    Every member is checked before anything is written, as its header is read, so a bomb is refused after reading
    only its headers: no absolute path, no `..`, no device or FIFO, no sparse member, no duplicate, nothing under a
    link, links only inside, hard links only to earlier files; within `limits` (count, bytes, ratio). Extraction then
    uses the standard library's ``data`` filter, and every extracted link must resolve inside `destination`.
    Raises `ArchiveTooLargeError` (over the limits), `UnsafeArchiveInputError` (anything else about the archive),
    `InfrastructureError` (the destination cannot be written: full disk)."""
    budget = limits.budget(os.stat(archive).st_size)
    destination.mkdir(parents=True, exist_ok=True)
    try:
        with (
            open(archive, "rb") as raw,
            gzip.GzipFile(fileobj=raw, mode="rb") as unzipped,
            tarfile.open(fileobj=_BoundedReads(unzipped), mode="r:", tarinfo=_BoundedTarInfo) as tar,
        ):
            members = _checked_members(tar, what, limits, budget)
            tar.extractall(destination, members=members, filter="data")
    except UnsafeArchiveInputError:
        raise  # already one line naming the archive (and an InputError is a ValueError: keep it from below)
    except _HeaderRefused as exc:
        raise UnsafeArchiveInputError(f"refusing to extract {what}: {exc}") from None
    except tarfile.FilterError as exc:
        raise UnsafeArchiveInputError(f"refusing to extract {what}: {exc}") from None
    except (tarfile.TarError, gzip.BadGzipFile, EOFError, zlib.error, ValueError) as exc:
        raise UnsafeArchiveInputError(f"{what} is not a valid tar.gz archive ({exc})") from None
    except OSError as exc:
        raise InfrastructureError(f"{what}: cannot extract into {destination}: {exc.strerror or exc}") from None
    real_root = os.path.realpath(destination)
    for dirpath, dirnames, filenames in os.walk(destination):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) and not is_within(os.path.realpath(path), real_root):
                relative = os.path.relpath(path, destination)
                raise UnsafeArchiveInputError(
                    f"refusing to extract {what}: link {relative!r} resolves outside the folder"
                )
    return len(members)


def is_within(path: str, root: str) -> bool:
    """Whether the resolved `path` is `root` or lies below it (both already `os.path.realpath`)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _checked_members(tar: tarfile.TarFile, what: str, limits: ArchiveLimits, budget: int) -> list[tarfile.TarInfo]:
    """The archive's members, each checked as its header is read (see `extract_tar_gz`)."""
    kinds: dict[str, tarfile.TarInfo] = {}
    members: list[tarfile.TarInfo] = []
    total = names = 0
    for member in tar:
        name = member.name
        parts = [part for part in name.split("/") if part not in ("", ".")]

        def refuse(reason: str, name: str = name) -> UnsafeArchiveInputError:
            return UnsafeArchiveInputError(f"refusing to extract {what}: member {name[:200]!r} {reason}")

        members.append(member)
        total += max(member.size, 0) if member.isreg() else 0
        names += len(name) + len(member.linkname)
        if len(members) > limits.max_entries:
            raise ArchiveTooLargeError(f"refusing to extract {what}: more than {limits.max_entries:,} members")
        if total > budget:
            raise ArchiveTooLargeError(
                f"refusing to extract {what}: more than {budget:,} bytes unpacked (limits: {limits.max_bytes:,} "
                f"bytes, {limits.max_ratio:g} bytes per archive byte past {limits.ratio_floor:,})"
            )
        if names > ARCHIVE_MAX_NAME_BYTES or max(len(name), len(member.linkname)) > ARCHIVE_MAX_NAME_LENGTH:
            raise refuse("has a name or link target longer than any file system takes")
        if name.startswith("/"):
            raise refuse("has an absolute path")
        if ".." in parts:
            raise refuse("has a '..' path segment")
        if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
            raise refuse("is a device or FIFO")
        if member.issparse():
            raise refuse("is a sparse file")
        if not parts:
            if member.isdir():
                continue  # the "./" entry of the archive root
            raise refuse("has an empty path")
        normalised = "/".join(parts)
        if normalised in kinds:
            raise refuse("appears twice")
        for depth in range(1, len(parts)):
            parent = kinds.get("/".join(parts[:depth]))
            if parent is not None and not parent.isdir():
                raise refuse("lies under a link or file, so writing it could follow a link")
        if member.issym():
            if not member.linkname or member.linkname.startswith("/"):
                raise refuse(f"is a link to an absolute path {member.linkname!r}")
            target = posixpath.normpath(posixpath.join(posixpath.dirname(normalised), member.linkname))
            if target == ".." or target.startswith("../"):
                raise refuse(f"is a link pointing outside ({member.linkname!r})")
        if member.islnk():
            source = kinds.get("/".join(part for part in member.linkname.split("/") if part not in ("", ".")))
            if source is None or not source.isreg():
                raise refuse(f"is a hard link to {member.linkname!r}, which is not an earlier file of the archive")
        kinds[normalised] = member
    return members
