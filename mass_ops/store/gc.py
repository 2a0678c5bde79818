"""Garbage collection of the artifact store: staging leftovers, and artifacts no metadata row references.

Staging leftovers older than the grace period are removed when ``dry_run=False``. Unreferenced artifacts are only
listed, unless ``dry_run=False`` and ``delete_unreferenced=True``, and even then one younger than the grace period is
kept. Only a store carrying its marker (`STORE_MARKER`) is swept; any other location is refused before it is read.
`gc(store, repository)` is the whole operation; `GcReport.lines()` is the text a command prints.
Why the two kinds are treated differently: docs/storage.md (`mass_ops.store.gc`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mass_ops.errors import InputError
from mass_ops.store.artifacts import STORE_MARKER, ArtifactNotFoundError, ArtifactStore, StagingLeftover
from mass_ops.store.errors import one_line_reason
from mass_ops.store.repository import MetadataRepository

GRACE_ENV = "MASS_STORE_GC_GRACE_S"
DEFAULT_GRACE_S = 6 * 3600.0  # far beyond the slowest put (multi-GB model files) and the publish-then-record gap


class GcSettingError(InputError):
    """The grace period is not a usable number of seconds."""


class NotAMassOpsStoreError(InputError):
    """The location `gc` was pointed at carries no mass-ops store marker: nothing there is ours to delete."""


def require_store_marker(store: ArtifactStore) -> None:
    """Return when `store` carries the mass-ops marker, else raise `NotAMassOpsStoreError` (one line naming the URL,
    the marker, and how a store of an older mass-ops gets it)."""
    if not store.is_marked():
        raise NotAMassOpsStoreError(
            f"{store.url} is not a mass-ops artifact store: it has no {STORE_MARKER} marker at its root (the first "
            "run written to a store puts it there); nothing was removed. For the store of an older mass-ops, mark "
            "it with `mass-ops store init` and the same --config/--set"
        )


def grace_from_env() -> float:
    """``MASS_STORE_GC_GRACE_S`` (seconds, at least 60), or the default of 6 hours."""
    raw = os.environ.get(GRACE_ENV, "").strip()
    if not raw:
        return DEFAULT_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 60:
        raise GcSettingError(f"{GRACE_ENV}={raw!r} must be a number of seconds, at least 60")
    return value


@dataclass
class GcReport:
    """What `gc` found and did."""

    store_url: str
    dry_run: bool
    grace_s: float
    leftovers: list[StagingLeftover] = field(default_factory=list)
    removed: list[StagingLeftover] = field(default_factory=list)
    unreferenced: list[str] = field(default_factory=list)  # keys
    deleted: list[str] = field(default_factory=list)  # keys
    kept_young: list[str] = field(default_factory=list)  # unreferenced but within the grace period
    referenced: int = 0  # artifacts of the store some row references
    failures: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """One line per item, then a summary line (the output of ``mass-ops store gc``)."""
        out = []
        removed = {leftover.location for leftover in self.removed}
        for leftover in self.leftovers:
            verb = "removed" if leftover.location in removed else "would remove" if self.dry_run else "kept"
            size = f" {_size(leftover.size)}" if leftover.size is not None else ""
            out.append(f"leftover\t{verb}\t{leftover.kind}\t{leftover.location}{size}\tage {_age(leftover.age_s)}")
        deleted = set(self.deleted)
        young = set(self.kept_young)
        for key in self.unreferenced:
            verb = "deleted" if key in deleted else "kept (younger than grace)" if key in young else "listed"
            out.append(f"unreferenced\t{verb}\t{key}")
        out.extend(f"failed\t{failure}" for failure in self.failures)
        leftover_bytes = sum(leftover.size or 0 for leftover in self.leftovers)
        mode = "dry run" if self.dry_run else "applied"
        out.append(
            f"{mode}: {self.store_url}: {len(self.leftovers)} staging leftovers ({_size(leftover_bytes)}) older than "
            f"{_age(self.grace_s)}, {len(self.removed)} removed; {len(self.unreferenced)} unreferenced artifacts, "
            f"{len(self.deleted)} deleted; {self.referenced} referenced; {len(self.failures)} failures"
        )
        return out


def gc(
    store: ArtifactStore,
    repository: MetadataRepository,
    dry_run: bool = True,
    *,
    delete_unreferenced: bool = False,
    grace_s: float | None = None,
) -> GcReport:
    """Find staging leftovers and unreferenced artifacts of `store`; remove leftovers unless `dry_run`. A store
    without the mass-ops marker is refused first (`NotAMassOpsStoreError`), even for a dry run.

    Referenced artifacts are never deleted. Unreferenced ones are deleted only with ``dry_run=False`` and
    ``delete_unreferenced=True``, and only once older than `grace_s` (default: `grace_from_env`). Failures to
    remove one item are collected in the report (one line each) and do not stop the rest.
    """
    grace = grace_from_env() if grace_s is None else grace_s
    require_store_marker(store)
    report = GcReport(store.url, dry_run, grace)
    report.leftovers = store.staging_leftovers(grace)
    if not dry_run:
        for leftover in report.leftovers:
            try:
                leftover.remove()
            except Exception as exc:  # one stuck item must not stop the sweep; it is reported
                report.failures.append(f"{leftover.location}: {one_line_reason(exc)}")
            else:
                report.removed.append(leftover)

    references = set(repository.artifact_uris())
    for key in store.list():
        if _is_referenced(store.uri(key), references):
            report.referenced += 1
        else:
            report.unreferenced.append(key)
    if not dry_run and delete_unreferenced:
        for key in report.unreferenced:
            _delete_unreferenced(store, key, grace, report)
    return report


def _delete_unreferenced(store: ArtifactStore, key: str, grace: float, report: GcReport) -> None:
    try:
        if store.age_s(key) <= grace:
            report.kept_young.append(key)
            return
        store.delete(key)
    except ArtifactNotFoundError:
        return  # deleted meanwhile
    except Exception as exc:  # reported, the sweep goes on
        report.failures.append(f"{store.uri(key)}: {one_line_reason(exc)}")
    else:
        report.deleted.append(key)


def _is_referenced(uri: str, references: set[str]) -> bool:
    """Whether `uri` or a prefix folder of it (``.../a`` for ``.../a/b``) is among `references`."""
    if uri in references:
        return True
    candidate = uri
    while "/" in candidate:
        candidate = candidate.rsplit("/", 1)[0]
        if candidate.endswith(":/") or candidate.endswith(":"):
            return False
        if candidate in references or f"{candidate}/" in references:
            return True
    return False


def _size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
