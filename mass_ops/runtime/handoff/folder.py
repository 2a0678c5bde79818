"""The folder both containers of an episode pod share: its file names, timings, errors and safe reads and writes.

`Handoff` writes each file atomically (temporary name, then rename) and follows no link the other side may have
planted; it reads a document once, below the folder, as a regular file with one link. `Heartbeat` keeps a side's
`*.alive` file fresh; `wait_for` polls until the other side answers, fails or stops. Layout: docs/handoff.md.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from mass_ops.errors import InfrastructureError
from mass_ops.layout import HANDOFF_PROMPT_FILE
from mass_ops.store.untrusted import JSON_MAX_BYTES, UntrustedInputError, read_beneath

PROMPT_FILE = HANDOFF_PROMPT_FILE
SEED_FILE = "workspace-seed.tar.gz"
REQUEST_FILE = "request.json"
LEDGER_FILE = "ledger.json"
COMPLETE_FILE = "complete.json"
PUBLISHER_FAILED_FILE = "publisher-failed.json"
PUBLICATION_FILE = "publication.json"
SANDBOX_ALIVE = "sandbox.alive"
PUBLISHER_ALIVE = "publisher.alive"
SESSIONS_DIR = "sessions"
PROMPT_MAX_BYTES = 64 << 20
HEARTBEAT_INTERVAL_S = 2.0
POLL_S = 0.2
# A side whose heartbeat is older than this has stopped (a container killed, OOM): the other side gives up.
DEFAULT_STALE_AFTER_S = 60.0
# How long each side waits for the other to start: both containers of a pod start together, but Python imports
# and, for the publisher, the first database round trip take a while on a busy node.
DEFAULT_START_TIMEOUT_S = 600.0
# The files of an attempt folder besides publication.json, in stored form (the workspace as its tarball).
ATTEMPT_FILES = ("workspace", "prompt", "stream", "stderr", "api_log", "settings")
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC

_Model = TypeVar("_Model", bound=BaseModel)
_T = TypeVar("_T")


class HandoffError(InfrastructureError):
    """The other side failed, gave up or broke the protocol; the message is one line."""


class IncompleteHandoffError(HandoffError):
    """The hand-off ended without its marker, or holds something it must not: nothing of it was published."""


@dataclass(frozen=True)
class Handoff:
    """The shared folder (its layout: docs/handoff.md)."""

    root: Path

    def path(self, name: str) -> Path:
        return self.root / name

    def attempt_dir(self, slug: str, attempt: int) -> Path:
        return self.root / "attempts" / slug / f"a{attempt}"

    def ack_path(self, slug: str, attempt: int) -> Path:
        return self.root / "acks" / f"{slug}-a{attempt}.json"

    def write(self, path: Path, document: BaseModel) -> None:
        """Write `document` as JSON at `path` atomically (a reader sees all of it or nothing)."""
        self.write_bytes(path, document.model_dump_json().encode("utf-8"))

    def write_bytes(self, path: Path, data: bytes) -> None:
        """Write `data` at `path` atomically."""
        self.write_chunks(path, [data])

    def write_chunks(self, path: Path, chunks: Iterable[bytes]) -> None:
        """Write `chunks` at `path` (below the folder) atomically, following no link: the other side may have put
        one at the path, its temporary name or any folder on the way, and a write must not land elsewhere.
        `IncompleteHandoffError` when a folder on the way is a link."""
        relative = path.relative_to(self.root)
        name, temp = relative.name, f".{relative.name}.partial"
        self.root.mkdir(parents=True, exist_ok=True)  # the shared volume itself: no other side chose it
        folder = os.open(self.root, _FOLDER_FLAGS)
        try:
            for part in relative.parts[:-1]:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=folder)
                try:
                    inner = os.open(part, _FOLDER_FLAGS | os.O_NOFOLLOW, dir_fd=folder)
                except OSError:
                    raise IncompleteHandoffError(f"hand-off {self.root}: {part}/ is a link or not a folder") from None
                os.close(folder)
                folder = inner
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=folder)
            fd = os.open(
                temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder
            )
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
            os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)  # a link at `name` is replaced, not followed
        finally:
            os.close(folder)

    def read(self, path: Path, model: type[_Model]) -> _Model:
        """The document at `path` (below the folder: opened once, no link followed, a regular file with one link, at
        most `JSON_MAX_BYTES`); `IncompleteHandoffError` naming it when it is not a valid `model`."""
        try:
            data = read_beneath(self.root, path.relative_to(self.root), max_bytes=JSON_MAX_BYTES)
        except (FileNotFoundError, UntrustedInputError, ValueError):
            raise IncompleteHandoffError(f"hand-off {self.root}: {self._name(path)} is not a regular file") from None
        try:
            return model.model_validate_json(data)
        except (OSError, ValidationError) as exc:
            problem = exc.errors()[0] if isinstance(exc, ValidationError) else {"msg": str(exc), "loc": ()}
            where = ".".join(str(part) for part in problem["loc"]) or "document"
            raise IncompleteHandoffError(
                f"hand-off {self.root}: {self._name(path)} is not a valid {model.__name__}: {where}: {problem['msg']}"
            ) from None

    def age_s(self, name: str) -> float | None:
        """Seconds since heartbeat `name` was last touched, or None when it never was."""
        try:
            return max(0.0, time.time() - self.path(name).stat().st_mtime)
        except FileNotFoundError:
            return None

    def _name(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)


class Heartbeat:
    """Touches a file every `interval_s` seconds on a daemon thread, from `__enter__` to `__exit__`."""

    def __init__(self, path: Path, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.path = path
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{path.name}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError):
                self.path.touch()


def wait_for(found: Callable[[], _T | None], problem: Callable[[], str | None], *, timeout_s: float, what: str) -> _T:
    """Poll until `found()` returns something; `problem()` (the other side failed or stopped) and the timeout end the
    wait with `HandoffError`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = found()
        if value is not None:
            return value
        reason = problem()
        if reason is not None:
            raise HandoffError(f"{what}: {reason}")
        if time.monotonic() >= deadline:
            raise HandoffError(f"{what}: nothing after {timeout_s:g} s")
        time.sleep(POLL_S)
