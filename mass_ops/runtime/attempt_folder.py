"""An attempt's private folder: its layout (`AttemptPaths`), its lock, its fresh start and its removal.

The folder `<scratch>/<cycle>/<unit slug>-a<attempt>/` is deterministic, so the workspace path the agent sees is the
same on every rerun: `workspace/`, `home/.qwen/settings.json` (HOME and QWEN_HOME), `tmp/` and `logs/`. An exclusive
`flock` beside it (`lock_attempt`) keeps a second process off the same attempt (`EpisodeBusyError`); holding it, a
leftover folder is a crashed attempt's scratch and is removed before the attempt starts (`fresh_attempt_folder`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mass_ops.errors import InfrastructureError
from mass_ops.layout import EPISODE_FILES
from mass_ops.runtime.settings import SETTINGS_FILE


class EpisodeBusyError(InfrastructureError):
    """The same attempt of the same unit is running in another process (its attempt folder is locked)."""


@dataclass(frozen=True)
class AttemptPaths:
    """Files and folders of one attempt (see the module docstring)."""

    root: Path

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def qwen_home(self) -> Path:
        return self.home / ".qwen"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def settings(self) -> Path:
        return self.qwen_home / SETTINGS_FILE

    @property
    def settings_record(self) -> Path:
        """The runner's own copy of the settings it gave the agent, out of the agent's reach: what is published
        (the agent's `settings` file is its own to rewrite while it runs)."""
        return self.logs / SETTINGS_FILE

    @property
    def prompt(self) -> Path:
        return self.logs / EPISODE_FILES["prompt"]

    @property
    def stream(self) -> Path:
        return self.logs / EPISODE_FILES["stream"]

    @property
    def stderr(self) -> Path:
        return self.logs / EPISODE_FILES["stderr"]

    @property
    def api_log(self) -> Path:
        return self.logs / "api_requests.jsonl"

    @property
    def api_log_gz(self) -> Path:
        return self.logs / EPISODE_FILES["api_log"]

    def create(self) -> None:
        for folder in (self.workspace, self.qwen_home, self.tmp, self.logs):
            folder.mkdir(parents=True, exist_ok=False)


class AttemptLock:
    """An exclusive `flock` on `.<attempt folder>.lock` beside the attempt folder."""

    def __init__(self, path: Path, handle: Any) -> None:
        self.path = path
        self._handle = handle

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
        fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
        self._handle.close()


def lock_attempt(root: Path, unit_key: str) -> AttemptLock:
    root.parent.mkdir(parents=True, exist_ok=True)
    path = root.with_name(f".{root.name}.lock")
    handle = open(path, "a")  # noqa: SIM115 - held open until release()
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise EpisodeBusyError(
            f"episode {unit_key}: this attempt is already running in another process ({root})"
        ) from None
    return AttemptLock(path, handle)


def fresh_attempt_folder(paths: AttemptPaths, prompt: str) -> None:
    # We hold the lock, so no live run owns a leftover folder: it is the scratch of an attempt that crashed before
    # its row, which makes it no evidence of anything. Start clean.
    remove_tree(paths.root)
    paths.create()
    paths.prompt.write_text(prompt, encoding="utf-8")


def make_readable(root: Path) -> None:
    """Give the owner read access to everything the agent left (a `chmod 000` must not break the tarball)."""
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            path = Path(folder) / name
            if not path.is_symlink():
                with contextlib.suppress(OSError):
                    path.chmod(path.stat().st_mode | stat.S_IRWXU)
        for name in files:
            path = Path(folder) / name
            if not path.is_symlink():
                with contextlib.suppress(OSError):
                    path.chmod(path.stat().st_mode | stat.S_IRUSR | stat.S_IWUSR)


def remove_tree(root: Path) -> None:
    if not root.exists():
        return
    make_readable(root)
    shutil.rmtree(root, ignore_errors=True)
