"""What a stage asks of the episode runtime, and what it gets back.

Stages (search, collection, rollouts) describe episodes as `EpisodeRequest`s and hand them to an `EpisodeExecutor`.
The executor owns everything below that line: skipping units that are already done, running qwen-code behind the
logging proxy, publishing artifacts before the row, retrying infrastructure failures as new attempts with the same
seed, and concurrency within the endpoint's capacity. It returns one `EpisodeOutcome` per request: the final attempt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from mass_ops.layout import EpisodeKind, EpisodeUnit

EpisodeStatus = Literal["succeeded", "model_failure", "infra_failure", "budget_exhausted"]


@dataclass(frozen=True)
class EpisodeRequest:
    """One episode unit to run: its identity (without attempt), condition and prompt text."""

    unit: EpisodeUnit
    condition: str
    prompt: str
    generation: str | None = None

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
    status_record: dict
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
        """Materialise the episode's workspace (for evidence bundles) under `dest`; returns its root."""
        ...
