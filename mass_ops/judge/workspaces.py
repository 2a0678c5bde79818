"""Where a judged workspace comes from: the episode executor (search) or the stored workspace artifact (ranking).

Evidence is built from a workspace materialised in a scratch folder that is removed once the bundle exists.
A workspace the platform refuses to unpack (over the archive limits of `store.untrusted`, or unsafe) is not an
error of the stage: its evidence is a refused bundle, built once per process, and the pair's outcome follows from
it without a judge call (`PairwiseJudge.judge`), recorded like any verdict so a rerun reuses it.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar, cast

from mass_ops.judge.evidence import EvidenceBundle, EvidenceCaps, EvidenceError, build_bundle, refused_bundle
from mass_ops.prompts import PromptSet
from mass_ops.runtime.episode import EpisodeExecutor, EpisodeOutcome
from mass_ops.store.artifacts import ArtifactKeyError, ArtifactStore, UnsafeArchiveError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WorkspaceSource(Protocol):
    """A workspace that can be materialised on local disk."""

    @property
    def name(self) -> str:
        """Root name shown in the directory tree (e.g. ``query51_ourTeam``)."""
        ...

    @property
    def location(self) -> str:
        """How prompts refer to the workspace (a URI or an episode identity)."""
        ...

    def materialize(self, dest: Path) -> Path:
        """Put the workspace under the empty folder `dest`; return its root."""
        ...


@dataclass(frozen=True)
class ExecutorWorkspace:
    """The workspace of an episode outcome, materialised by the executor that ran it."""

    executor: EpisodeExecutor
    outcome: EpisodeOutcome
    name: str

    @property
    def location(self) -> str:
        return self.outcome.artifacts.get("workspace") or f"episode {self.outcome.request.unit.slug}"

    def materialize(self, dest: Path) -> Path:
        return self.executor.workspace(self.outcome, dest / self.name)


def key_for_uri(artifacts: ArtifactStore, uri: str) -> str:
    """The store key of a workspace's URI; EvidenceError when the URI lies outside the configured store."""
    try:
        return artifacts.key_of(uri)
    except ArtifactKeyError as exc:
        raise EvidenceError(f"workspace {exc}") from None


@dataclass(frozen=True)
class StoredWorkspace:
    """A workspace tarball in the artifact store, named by its URI (the episode row's `artifacts['workspace']`)."""

    artifacts: ArtifactStore
    uri: str
    name: str

    @property
    def location(self) -> str:
        return self.uri

    def materialize(self, dest: Path) -> Path:
        target = dest / self.name
        self.artifacts.get_dir(key_for_uri(self.artifacts, self.uri), target)
        return target


@contextmanager
def materialized(source: WorkspaceSource) -> Iterator[Path]:
    """The workspace of `source` in a scratch folder, removed when the block ends."""
    with tempfile.TemporaryDirectory(prefix="mass-evidence-") as scratch:
        yield source.materialize(Path(scratch))


def evidence_of(
    source: WorkspaceSource,
    build: Callable[[Path, WorkspaceSource], T],
    refuse: Callable[[T, str], T] | None = None,
) -> T:
    """`build(root, source)` over the materialised workspace; when the platform refuses to unpack it, `build` over
    an empty folder marked by `refuse(value, reason)` (default: the value is an `EvidenceBundle`, `refused_bundle`),
    with one warning line naming the workspace and why."""
    try:
        with materialized(source) as root:
            return build(root, source)
    except UnsafeArchiveError as exc:  # the agent's doing (too large, unsafe): an outcome of the pair, not a crash
        reason = " ".join(str(exc).split())
    logger.warning("workspace %s not judged: %s", source.location, reason)
    with tempfile.TemporaryDirectory(prefix="mass-evidence-") as scratch:
        empty = Path(scratch) / source.name
        empty.mkdir()
        value = build(empty, source)
    if refuse is not None:
        return refuse(value, reason)
    if not isinstance(value, EvidenceBundle):
        raise TypeError(f"evidence of {source.location} is a {type(value).__name__}: pass refuse= to mark it")
    return cast(T, refused_bundle(value, reason))


def bundle_workspace(
    source: WorkspaceSource, *, task_id: int, task_text: str, caps: EvidenceCaps, prompts: PromptSet | None = None
) -> EvidenceBundle:
    """Evidence bundle of `source`, built in a scratch folder that is removed afterwards (refused: `evidence_of`);
    `prompts`: the templates whose cut markers apply (default: the shipped ones)."""

    def build(root: Path, source: WorkspaceSource) -> EvidenceBundle:
        return build_bundle(
            root,
            task_id=task_id,
            task_text=task_text,
            location=source.location,
            caps=caps,
            name=source.name,
            prompts=prompts,
        )

    return evidence_of(source, build)


class EvidenceCache(Generic[T]):
    """Builds the evidence of each workspace once, however many comparisons it takes part in (thread-safe).

    `build(root, source)` turns a materialised workspace into the cached value (a bundle, or a bundle and the
    optimizer's appendix); values are keyed by the caller (an episode id or name). A refused workspace is cached
    too, as `evidence_of` marks it (`refuse`), so it is fetched and refused once per process.
    """

    def __init__(
        self, build: Callable[[Path, WorkspaceSource], T], *, refuse: Callable[[T, str], T] | None = None
    ) -> None:
        self._build = build
        self._refuse = refuse
        self._values: dict[str, T] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, key: str, source: WorkspaceSource) -> T:
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._values:
                self._values[key] = evidence_of(source, self._build, self._refuse)
            return self._values[key]
