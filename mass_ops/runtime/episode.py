"""What a stage asks of the episode runtime, and what it gets back.

Stages (search, collection, rollouts) describe episodes as `EpisodeRequest`s and hand them to an `EpisodeExecutor`.
The executor owns everything below that line: skipping units that are already done, running qwen-code behind the
logging proxy, publishing artifacts before the row, retrying infrastructure failures as new attempts with the same
seed, and concurrency within the endpoint's capacity. It returns one `EpisodeOutcome` per request: the final attempt.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from mass_ops.layout import EpisodeKind, EpisodeUnit, cycle_prefix
from mass_ops.store.untrusted import ARCHIVE_LIMITS

EpisodeStatus = Literal["succeeded", "model_failure", "infra_failure", "budget_exhausted"]


_HEX64 = re.compile(r"[0-9a-f]{64}")
# A workspace seed is a benchmark task's inputs: a repository checkout with its commit's pack, a task's files. The
# limits keep a wrong or hostile archive from filling the sandbox's disk (its emptyDir has a size limit too); they
# are the platform's one set of archive limits, shared with every workspace the judge or evaluation unpacks.
SEED_MAX_ENTRIES = ARCHIVE_LIMITS.max_entries
SEED_MAX_BYTES = ARCHIVE_LIMITS.max_bytes


@dataclass(frozen=True)
class WorkspaceSeed:
    """What an episode's workspace holds before its agent starts: a deterministic tar.gz artifact (its URI) and the
    SHA-256 it must have. A benchmark task's inputs (a repository checked out at its base commit, a task's
    environment files); the runner extracts it safely into the fresh workspace (`runner.extract_workspace_seed`)
    and the attempt's status document names it. Stored content-addressed (`workspace_seed_key`)."""

    uri: str
    sha256: str

    def __post_init__(self) -> None:
        if not _HEX64.fullmatch(self.sha256):
            raise ValueError(f"workspace seed {self.uri}: {self.sha256!r} is not a lowercase hex SHA-256")

    def as_dict(self) -> dict[str, str]:
        return {"uri": self.uri, "sha256": self.sha256}


def workspace_seed_key(cycle: str, sha256: str) -> str:
    """The artifact key of a cycle's workspace seed of this SHA-256 (the same seed is stored once)."""
    if not _HEX64.fullmatch(sha256):
        raise ValueError(f"workspace seed: {sha256!r} is not a lowercase hex SHA-256")
    return f"{cycle_prefix(cycle)}/workspace-seeds/{sha256}.tar.gz"


@dataclass(frozen=True)
class EpisodeRequest:
    """One episode unit to run: its identity (without attempt), condition and prompt text, and — for a benchmark
    task that gives its agent files — the workspace seed the agent starts from (None: an empty workspace)."""

    unit: EpisodeUnit
    condition: str
    prompt: str
    generation: str | None = None
    workspace_seed: WorkspaceSeed | None = None

    def __post_init__(self) -> None:
        # The generation belongs to the unit's identity; this field mirrors it for callers that read it here.
        if self.generation is None:
            object.__setattr__(self, "generation", self.unit.generation)
        elif self.generation != self.unit.generation:
            raise ValueError(
                f"episode {self.unit.slug}: request generation {self.generation!r} differs from its unit's "
                f"{self.unit.generation!r}"
            )

    @property
    def kind(self) -> EpisodeKind:
        """Reference, search, collection, rollout or benchmark."""
        return self.unit.kind

    @property
    def prompt_sha256(self) -> str:
        """Hash of the prompt: a unit's prompt may never change (MASS_SPEC §1 episode idempotency)."""
        return hashlib.sha256(self.prompt.encode()).hexdigest()


@dataclass(frozen=True)
class EpisodeOutcome:
    """The final recorded attempt of one episode unit.

    `status` is `succeeded` (qwen-code reported a success result), `model_failure` (the agent failed: data for the
    optimizer), `infra_failure` (every allowed attempt hit an infrastructure failure) or `budget_exhausted` (its
    proxy refused a request a budget had no room for; rerun after raising it). `status_record` is the
    run_status document (MASS_SPEC §4 fields plus token totals); `artifacts` maps names of
    `mass_ops.layout.EPISODE_FILES` to URIs.
    """

    request: EpisodeRequest
    episode_id: int
    attempt: int
    status: EpisodeStatus
    status_record: dict[str, Any]
    artifacts: dict[str, str] = field(default_factory=dict)
    reused: bool = False

    @property
    def succeeded(self) -> bool:
        """Whether the episode counts as completed (ranking, selection and rendering use only these)."""
        return self.status == "succeeded"


class EpisodeExecutor(Protocol):
    """Runs episodes; implementations: local qwen-code processes, or Kubernetes pods."""

    def run(self, requests: Sequence[EpisodeRequest]) -> list[EpisodeOutcome]:
        """Run (or reuse) every request, concurrently within capacity; outcomes in request order.

        Raises on a unit whose stored prompt differs from the request's (never reruns a completed unit).
        """
        ...

    def workspace(self, outcome: EpisodeOutcome, dest: Path) -> Path:
        """Materialise the episode's workspace (for evidence bundles) under `dest`; returns its root. A workspace
        the platform will not unpack (over `store.untrusted.ARCHIVE_LIMITS`, or unsafe) raises
        `store.artifacts.UnsafeArchiveError` with nothing left under `dest`."""
        ...


class EpisodeIdentity(Protocol):
    """Which unit of a stage an episode is (what `mass_ops.compute.kubernetes.EpisodeSpec` carries)."""

    @property
    def kind(self) -> str: ...
    @property
    def task_id(self) -> int | str: ...
    @property
    def version(self) -> int | None: ...
    @property
    def candidate(self) -> int | None: ...
    @property
    def replicate(self) -> int | None: ...
    @property
    def generation(self) -> str | None: ...


def describe(identity: EpisodeIdentity) -> str:
    """`search episode t51 v3`, `rollout episode t60 r2 of L1`: the identity in error messages."""
    parts = [f"{identity.kind} episode t{identity.task_id}"]
    for prefix, value in (("v", identity.version), ("c", identity.candidate), ("r", identity.replicate)):
        if value is not None:
            parts.append(f"{prefix}{value}")
    if identity.generation:
        parts.append(f"of {identity.generation}")
    return " ".join(parts)
