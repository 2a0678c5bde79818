"""The documents the two sides of a pod's hand-off exchange as JSON files (the folder: docs/handoff.md).

Each is a frozen pydantic model that forbids unknown fields, so a document the other side wrote either validates
whole or is refused (`Handoff.read`). The sandbox writes `HandoffRequest`, `AttemptHandoff` and `Completion`; the
publisher writes `Ledger`, `Ack`, `PublisherFailure`, `SessionGrant` and `SessionClosed`.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, StringConstraints

from mass_ops.layout import BENCHMARK_TASK_NAME, EpisodeKind, EpisodeUnit
from mass_ops.runtime.episode import EpisodeRequest, EpisodeStatus
from mass_ops.runtime.runner import EpisodeRecord

FORMAT: Final = 1
_HEX64 = r"^[0-9a-f]{64}$"


class _Document(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HandoffUnit(_Document):
    """One unit the sandbox runs, as announced before any agent started."""

    task_id: PositiveInt | Annotated[str, StringConstraints(pattern=f"^{BENCHMARK_TASK_NAME.pattern}$")]
    kind: EpisodeKind
    seed: NonNegativeInt
    version: NonNegativeInt | None = None
    candidate: NonNegativeInt | None = None
    generation: str | None = None
    condition: str
    prompt_sha256: str = Field(pattern=_HEX64)
    workspace_seed_sha256: str | None = Field(default=None, pattern=_HEX64)

    @classmethod
    def of_request(cls, request: EpisodeRequest) -> HandoffUnit:
        unit = request.unit
        seed = request.workspace_seed
        return cls(
            task_id=unit.task_id,
            kind=unit.kind,
            seed=unit.seed,
            version=unit.version,
            candidate=unit.candidate,
            generation=unit.generation,
            condition=request.condition,
            prompt_sha256=request.prompt_sha256,
            workspace_seed_sha256=None if seed is None else seed.sha256,
        )

    def unit(self, cycle: str, attempt: int = 1) -> EpisodeUnit:
        return EpisodeUnit(
            cycle,
            self.task_id,  # type: ignore[arg-type]  # a benchmark unit's task is its instance name (str)
            self.kind,
            self.seed,
            self.version,
            self.candidate,
            attempt,
            self.generation,
        )


class HandoffRequest(_Document):
    format: Literal[1] = FORMAT
    cycle: str
    config_hash: str = Field(pattern=_HEX64)
    units: list[HandoffUnit] = Field(min_length=1)


class RecordedAttempt(_Document):
    """One recorded attempt of a unit, as the pool's planning reads it (the fields of the `Episode` row it uses)."""

    id: int
    attempt: PositiveInt
    status: str
    prompt_sha256: str | None
    artifacts: dict[str, str] = {}
    status_record: dict[str, Any] | None = None  # only for a final attempt: a reused outcome reports it


class ServingTarget(_Document):
    """The server of the generation a rollout evaluates (`mass_ops.serving.GenerationServer`)."""

    generation: str
    endpoint: str
    served_name: str


class ScopeSpend(_Document):
    """One budget scope's spend as the publisher read it when the pod started (the fields `BudgetLedger` reads)."""

    tokens: NonNegativeInt = 0
    cost_usd: float = 0.0
    requests: NonNegativeInt = 0
    refused_need: NonNegativeInt | None = None


class Ledger(_Document):
    format: Literal[1] = FORMAT
    cycle_id: int
    artifact_url: str
    serving: ServingTarget | None = None
    attempts: dict[str, list[RecordedAttempt]]  # by unit slug, first attempt first
    # the announced units' task and cycle budget scopes at the pod's start: the sandbox's pool checks them before
    # each attempt as it would the store (the operator admitted the pod on the same rule)
    budget_spend: dict[str, ScopeSpend] = {}
    # the publisher opens each attempt's proxy session (the runner asks in sessions/; docs/handoff.md)
    proxy_sessions: bool = False


class AttemptHandoff(_Document):
    """publication.json: what the attempt's row and status document say (its files lie beside it)."""

    format: Literal[1] = FORMAT
    unit: str
    attempt: PositiveInt
    record: EpisodeRecord
    status: dict[str, Any]


class Ack(_Document):
    unit: str
    attempt: PositiveInt
    episode_id: int | None = None
    status: EpisodeStatus | None = None
    artifacts: dict[str, str] = {}
    status_record: dict[str, Any] | None = None
    error: str | None = None


class Completion(_Document):
    exit_code: int
    error: str | None = None


class PublisherFailure(_Document):
    error: str


class SessionGrant(_Document):
    """sessions/<id>.session.json: the attempt's proxy session (URL and token for the agent), or why not."""

    proxy_url: str | None = None
    token: str | None = None
    error: str | None = None
    transient: bool = False  # the endpoint or the proxy did not answer: the runner waits and asks again


class SessionClosed(_Document):
    """sessions/<id>.closed.json: the closed session's record count and usage as the proxy counted them."""

    records: NonNegativeInt = 0
    usage: dict[str, NonNegativeInt] = {}
    error: str | None = None
