"""A workspace seed (a benchmark task's inputs) fetched by URI, checked and extracted into a fresh workspace.

The archive comes through the context's store (in a pod, the hand-off folder the publisher delivered it to) and must
have its SHA-256. Its members are checked before anything is written (no absolute paths, no `..`, no links or hard
links leading outside, no devices, at most `SEED_MAX_ENTRIES` members and `SEED_MAX_BYTES` bytes), and extraction is
all or nothing. A seed that fails any check is one line (`WorkspaceSeedError`) and no agent starts.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

from mass_ops.errors import InputError, first_line
from mass_ops.runtime.attempt_folder import remove_tree
from mass_ops.runtime.episode import SEED_MAX_BYTES, SEED_MAX_ENTRIES, WorkspaceSeed
from mass_ops.store.artifacts import (
    ArtifactError,
    ArtifactFormatError,
    ArtifactKeyError,
    ArtifactNotFoundError,
    extract_tarball,
    file_sha256,
)
from mass_ops.store.untrusted import ARCHIVE_LIMITS


class WorkspaceSeedError(InputError):
    """An episode's workspace seed cannot be used: not in the store, other bytes than its SHA-256, not a tar.gz,
    unsafe or too large. Nothing of it is extracted and no agent starts; the message is one line."""


def fetch_workspace_seed(store: Any, seed: WorkspaceSeed, dest: Path) -> None:
    """Download the seed archive to `dest`, checked against its SHA-256; `WorkspaceSeedError` (one line) when the
    store does not hold it or holds other bytes. `store` is the context's: in an episode pod, the hand-off's."""
    try:
        store.get_file(store.key_of(seed.uri), dest, sha256=seed.sha256)
    except ArtifactKeyError as exc:
        raise WorkspaceSeedError(f"workspace seed: {exc}") from None
    except ArtifactNotFoundError:
        raise WorkspaceSeedError(f"workspace seed {seed.uri} does not exist") from None
    except ArtifactError as exc:
        raise WorkspaceSeedError(f"workspace seed {seed.uri}: {first_line(exc)}") from None


def extract_workspace_seed(
    archive: Path,
    workspace: Path,
    seed: WorkspaceSeed,
    *,
    max_entries: int = SEED_MAX_ENTRIES,
    max_bytes: int = SEED_MAX_BYTES,
) -> int:
    """Extract the seed archive (a tar.gz) into the empty folder `workspace`, all or nothing; returns its number of
    members. Refused with one line (`WorkspaceSeedError`), nothing extracted: bytes other than `seed.sha256`, more
    than `max_entries` members or `max_bytes` bytes or the platform's bytes-per-archive-byte limit, or a member that
    could write or point outside (`store.untrusted.extract_tar_gz`, the one extractor of every archive)."""
    where = f"workspace seed {seed.uri}"
    sha256, _size = file_sha256(archive)
    if sha256 != seed.sha256:
        raise WorkspaceSeedError(f"{where}: its bytes have SHA-256 {sha256[:12]}…, not {seed.sha256[:12]}…")
    if any(workspace.iterdir()):
        raise WorkspaceSeedError(f"{where}: the workspace {workspace} is not empty")
    # The platform's one archive extractor and its limits (count, bytes, ratio), checked as each header is read.
    limits = dataclasses.replace(ARCHIVE_LIMITS, max_entries=max_entries, max_bytes=max_bytes)
    scratch = workspace.with_name(f".{workspace.name}.seed")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        try:
            entries = extract_tarball(archive, scratch, uri=where, limits=limits)
        except ArtifactFormatError as exc:  # UnsafeArchiveError too: a member that could leave the folder
            raise WorkspaceSeedError(first_line(exc)) from None
        for entry in sorted(scratch.iterdir()):
            os.rename(entry, workspace / entry.name)
    except BaseException:
        # All or nothing: what was moved already goes too, so the workspace is empty again.
        for entry in list(workspace.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                remove_tree(entry)
            else:
                entry.unlink()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return entries
