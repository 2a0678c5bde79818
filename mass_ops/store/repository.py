"""Repository layer: idempotent recording of units of work and the queries the stages need.

Every ``record_*`` / ``ensure_*`` / ``register_*`` method is one transaction built on `_insert_once`: a dialect
``INSERT … ON CONFLICT (unique key) DO NOTHING`` followed by a select of the row under that key. Recording the same
unit twice — sequentially or from concurrent processes — therefore yields exactly one row, and every caller gets
that row back. Fields that define what the unit *is* (a prompt hash, a design text, a config hash) must agree with
the stored row, else the call raises instead of silently returning a different unit.

Rows that point at an artifact take its SHA-256 as published (``ArtifactInfo.sha256``) beside the URI
(``*_sha256`` arguments); readers hand it back to the artifact store so changed bytes are refused. `artifact_uris`
lists every URI the rows reference, for `mass_ops.store.gc`.

Methods return detached ORM objects (plain column values, no lazy relationships): callers never hold a session.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, aliased

from mass_ops.errors import InputError
from mass_ops.store.metadata import MetadataStore
from mass_ops.store.schema import (
    Base,
    BudgetCharge,
    BudgetSpend,
    CallPurpose,
    CallStatus,
    Checkpoint,
    Comparison,
    Cycle,
    CycleTask,
    Dataset,
    DataSplit,
    Episode,
    EpisodeKind,
    EpisodeLease,
    EpisodeStatus,
    Evaluation,
    Ledger,
    LLMCall,
    ModelGeneration,
    Ranking,
    RetainedWorkflow,
    RunStatus,
    Selection,
    TaskSplit,
    TrainingRun,
    TrainingWindow,
    Verdict,
    WindowRole,
    WorkflowVersion,
    episode_unit_key,
    episode_unit_slug,
    utcnow,
)

RowT = TypeVar("RowT", bound=Base)
TaskId = str | int


class ConfigChangedError(InputError):
    """A cycle name was reused with a different configuration."""


class UnitConflictError(InputError):
    """A unit was recorded again under the same key but with different defining content."""


class InvalidRecordError(InputError):
    """A record names a value outside its enumeration or a row that does not exist."""


@dataclass(frozen=True)
class UsageTotal:
    """Token and cost totals of one group (an LLM-call purpose or an episode kind)."""

    group: str
    count: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float | None


@dataclass(frozen=True)
class WindowGroup:
    """Windows of one (task, role) group of a dataset: what the task/role sampler draws from."""

    task_id: str
    role: str
    windows: int
    loss_tokens: int


WINDOW_FIELDS = frozenset(
    {
        "position",
        "episode_id",
        "task_id",
        "role",
        "is_main",
        "thread",
        "segment",
        "window_index",
        "n_windows",
        "n_tokens",
        "n_loss_tokens",
        "weight",
    }
)


def _member(enumeration: type[enum.StrEnum], value: str, what: str) -> str:
    try:
        return enumeration(value).value
    except ValueError:
        allowed = ", ".join(member.value for member in enumeration)
        raise InvalidRecordError(f"{what} {value!r} is not one of: {allowed}") from None


def _task(task_id: TaskId) -> str:
    text = str(task_id).strip()
    if not text:
        raise InvalidRecordError("task id is empty")
    return text


def _document(value: Mapping[str, Any] | None, what: str) -> dict[str, Any] | None:
    """A JSON column value as it will read back (tuples become lists, keys strings), so comparisons are fair."""
    if value is None:
        return None
    try:
        return json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidRecordError(f"{what} is not a JSON document: {exc}") from None


def _aware(value: datetime | None, what: str) -> datetime | None:
    if value is not None and value.tzinfo is None:
        raise InvalidRecordError(f"{what} {value.isoformat()} has no time zone; pass an aware datetime (UTC)")
    return value


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _sha256(value: str | None, what: str) -> str | None:
    """`value` as a lowercase SHA-256 hex digest, or None; anything else is an InvalidRecordError."""
    if value is None:
        return None
    digest = str(value).strip().lower()
    if not _SHA256.match(digest):
        raise InvalidRecordError(f"{what} {value!r} is not a SHA-256 hex digest (64 hex characters)")
    return digest


def _hashes(value: Mapping[str, str] | None, names: Mapping[str, str] | None, what: str) -> dict[str, str] | None:
    """Per-artifact hashes of an episode: every name must be one of its artifacts."""
    if value is None:
        return None
    unknown = sorted(set(value) - set(names or {}))
    if unknown:
        raise InvalidRecordError(f"{what} names artifacts the episode does not have: {', '.join(unknown)}")
    return {str(name): str(_sha256(digest, f"{what}[{name!r}]")) for name, digest in value.items()}


def _describe(key: Mapping[str, Any]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in key.items())


def _lease_key(
    task_id: TaskId, kind: str, seed: int, version: int | None, candidate: int | None, generation: str | None
) -> str:
    """The unit key a lease is stored under (the episode's unit key without its attempt)."""
    return episode_unit_slug(
        task_id=_task(task_id), kind=kind, seed=seed, version=version, candidate=candidate, generation=generation
    )


class MetadataRepository:
    """Typed, idempotent access to the metadata tables of one `MetadataStore`."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self._statement_cache: dict[tuple[type[Base], tuple[str, ...]], tuple[Any, Any]] = {}

    @classmethod
    def from_url(cls, url: str) -> MetadataRepository:
        return cls(MetadataStore(url))

    def __repr__(self) -> str:
        return f"MetadataRepository({self.store!r})"

    # -- generic machinery ---------------------------------------------------------------------------------------

    def _dialect_insert(self, model: type[Base]) -> Any:
        if self.store.dialect == "postgresql":
            return postgresql.insert(model)
        return sqlite.insert(model)

    def _statements(self, model: type[Base], key: tuple[str, ...]) -> tuple[Any, Any]:
        """The insert-once and select-by-key statements of a unique key, built once and reused.

        Values travel as execution parameters, not as literals in the statement, so SQLAlchemy's compiled-statement
        cache hits on every call (building a fresh statement per row cost more than the database round trips).
        """
        cached = self._statement_cache.get((model, key))
        if cached is None:
            insert = self._dialect_insert(model).on_conflict_do_nothing(index_elements=list(key)).returning(model)
            columns = model.__table__.c
            select = sa.select(model).where(*(columns[name] == sa.bindparam(f"key_{name}") for name in key))
            cached = self._statement_cache[(model, key)] = (insert, select)
        return cached

    def _insert_once(
        self,
        session: Session,
        model: type[RowT],
        key: Mapping[str, Any],
        values: Mapping[str, Any],
        must_match: Sequence[str] = (),
    ) -> RowT:
        """Insert the row unless its unique `key` exists; return the stored row either way.

        On Postgres a concurrent insert of the same key waits for the other transaction and then does nothing; on
        SQLite writers are serialised by ``BEGIN IMMEDIATE``. Either way the select below sees the winner's row.
        """
        statement, select = self._statements(model, tuple(key))
        try:
            inserted = session.scalars(statement, {**key, **values}).one_or_none()
        except sa.exc.IntegrityError as exc:
            reason = str(exc.orig).strip().splitlines()[0]
            raise InvalidRecordError(f"{model.__tablename__} ({_describe(key)}): {reason}") from None
        if inserted is not None:  # new unit: RETURNING saved the read-back round trip
            return inserted
        row = session.scalars(select, {f"key_{name}": value for name, value in key.items()}).one()
        for field in must_match:
            stored, given = getattr(row, field), values.get(field)
            if stored is not None and given is not None and stored != given:
                raise UnitConflictError(
                    f"{model.__tablename__} ({_describe(key)}) is already recorded with {field}={stored!r}; "
                    f"this call has {field}={given!r}"
                )
        return row

    def _record(
        self,
        model: type[RowT],
        key: Mapping[str, Any],
        values: Mapping[str, Any],
        must_match: Sequence[str] = (),
    ) -> RowT:
        with self.store.write() as session:
            return self._insert_once(session, model, key, values, must_match)

    def _one(self, statement: sa.Select[Any]) -> Any:
        with self.store.read() as session:
            return session.scalars(statement).one_or_none()

    def _all(self, statement: sa.Select[Any]) -> list[Any]:
        with self.store.read() as session:
            return list(session.scalars(statement).all())

    def _episode_of_cycle(self, session: Session, cycle_id: int, episode_id: int) -> Episode:
        episode = session.get(Episode, episode_id)
        if episode is None or episode.cycle_id != cycle_id:
            raise InvalidRecordError(f"episode {episode_id} does not exist in cycle {cycle_id}")
        return episode

    # -- cycles and tasks ----------------------------------------------------------------------------------------

    def ensure_cycle(
        self,
        name: str,
        config: Mapping[str, Any],
        config_hash: str,
        *,
        generation: int = 0,
        preset: str | None = None,
        parent_model: str | None = None,
    ) -> Cycle:
        """The cycle called `name`, created on first call; its config is frozen from then on.

        Raises ConfigChangedError when the cycle exists with another config hash.
        """
        now = utcnow()
        values = {
            "generation": generation,
            "preset": preset,
            "parent_model": parent_model,
            "config": _document(config, "cycle config"),
            "config_hash": config_hash,
            "status": RunStatus.PENDING.value,
            "created_at": now,
            "updated_at": now,
        }
        with self.store.write() as session:
            cycle = self._insert_once(session, Cycle, {"name": name}, values)
        if cycle.config_hash != config_hash:
            raise ConfigChangedError(
                f"cycle {name!r} was frozen with config hash {cycle.config_hash[:12]}…, this config hashes to "
                f"{config_hash[:12]}…; use a new cycle name to run a changed config"
            )
        return cycle

    def get_cycle(self, name: str) -> Cycle | None:
        return self._one(sa.select(Cycle).where(Cycle.name == name))

    def set_cycle_provenance(self, cycle_id: int, key: str, value: Any) -> Cycle:
        """Record what the cycle ran with under `key` of its provenance (the task catalogue's identity, the SHA-256 of
        each prompt template, …). A key once recorded never changes: a different value is a UnitConflictError (the
        same cycle name with other tasks or prompts would mix two experiments)."""
        with self.store.write() as session:
            cycle = session.get(Cycle, cycle_id)
            if cycle is None:
                raise InvalidRecordError(f"cycle {cycle_id} does not exist")
            recorded = dict(cycle.provenance or {})
            if key in recorded and recorded[key] != value:
                raise UnitConflictError(
                    f"cycle {cycle.name!r} recorded its {key} as {recorded[key]!r}; this run has {value!r}: use a new "
                    "cycle name to run with another one"
                )
            recorded[key] = value
            cycle.provenance = recorded
            return cycle

    def set_cycle_status(self, cycle_id: int, status: str) -> Cycle:
        """Move a cycle to `status`; finishing states stamp `finished_at`."""
        status = _member(RunStatus, status, "cycle status")
        with self.store.write() as session:
            cycle = session.get(Cycle, cycle_id)
            if cycle is None:
                raise InvalidRecordError(f"cycle {cycle_id} does not exist")
            cycle.status = status
            cycle.updated_at = utcnow()
            if status in (RunStatus.SUCCEEDED, RunStatus.FAILED):
                cycle.finished_at = cycle.updated_at
            return cycle

    def record_cycle_task(
        self,
        cycle_id: int,
        task_id: TaskId,
        split: str,
        *,
        excluded: bool = False,
        exclusion_reason: str | None = None,
        bare_prompt_sha256: str | None = None,
        initial_prompt_sha256: str | None = None,
    ) -> CycleTask:
        values = {
            "split": _member(TaskSplit, split, "task split"),
            "excluded": excluded,
            "exclusion_reason": exclusion_reason,
            "bare_prompt_sha256": bare_prompt_sha256,
            "initial_prompt_sha256": initial_prompt_sha256,
        }
        key = {"cycle_id": cycle_id, "task_id": _task(task_id)}
        return self._record(
            CycleTask, key, values, must_match=("split", "excluded", "bare_prompt_sha256", "initial_prompt_sha256")
        )

    def cycle_tasks(self, cycle_id: int, *, split: str | None = None) -> list[CycleTask]:
        statement = sa.select(CycleTask).where(CycleTask.cycle_id == cycle_id).order_by(CycleTask.id)
        if split is not None:
            statement = statement.where(CycleTask.split == _member(TaskSplit, split, "task split"))
        return self._all(statement)

    # -- RHI search ----------------------------------------------------------------------------------------------

    def record_workflow_version(
        self,
        cycle_id: int,
        task_id: TaskId,
        version: int,
        *,
        design: str,
        parent_version: int | None = None,
        diff: str | None = None,
        prompt_uri: str | None = None,
        prompt_sha256: str | None = None,
        proposal_call_id: int | None = None,
    ) -> WorkflowVersion:
        """Version `version` of a task's design. A different design under the same version is a UnitConflictError."""
        key = {"cycle_id": cycle_id, "task_id": _task(task_id), "version": version}
        values = {
            "design": design,
            "parent_version": parent_version,
            "diff": diff,
            "prompt_uri": prompt_uri,
            "prompt_sha256": prompt_sha256,
            "proposal_call_id": proposal_call_id,
        }
        return self._record(WorkflowVersion, key, values, must_match=("design", "prompt_sha256"))

    def workflow_versions(self, cycle_id: int, task_id: TaskId) -> list[WorkflowVersion]:
        """All versions of a task's design, v0 first."""
        return self._all(
            sa.select(WorkflowVersion)
            .where(WorkflowVersion.cycle_id == cycle_id, WorkflowVersion.task_id == _task(task_id))
            .order_by(WorkflowVersion.version)
        )

    def record_retained_workflow(
        self,
        cycle_id: int,
        task_id: TaskId,
        *,
        version: int | None,
        beats_reference: bool,
        last_evaluated_version: int,
        model: str | None = None,
    ) -> RetainedWorkflow:
        """The outcome of a task's search; `version` None means no version beat the reference."""
        key = {"cycle_id": cycle_id, "task_id": _task(task_id)}
        values = {
            "version": version,
            "beats_reference": beats_reference,
            "last_evaluated_version": last_evaluated_version,
            "model": model,
        }
        return self._record(RetainedWorkflow, key, values, must_match=("version", "beats_reference"))

    def retained_workflows(self, cycle_id: int) -> list[RetainedWorkflow]:
        return self._all(
            sa.select(RetainedWorkflow).where(RetainedWorkflow.cycle_id == cycle_id).order_by(RetainedWorkflow.id)
        )

    # -- episodes ------------------------------------------------------------------------------------------------

    def record_episode(
        self,
        cycle_id: int,
        *,
        task_id: TaskId,
        kind: str,
        seed: int,
        status: str,
        attempt: int = 1,
        version: int | None = None,
        candidate: int | None = None,
        generation: str | None = None,
        condition: str | None = None,
        model: str | None = None,
        exit_code: int | None = None,
        failure: Mapping[str, Any] | None = None,
        prompt_sha256: str | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        requests: int | None = None,
        max_prompt_tokens: int | None = None,
        started_at: datetime | None = None,
        finished_at: datetime | None = None,
        duration_s: float | None = None,
        artifacts: Mapping[str, str] | None = None,
        qwen_code_version: str | None = None,
        retry_of_id: int | None = None,
        artifact_sha256: Mapping[str, str] | None = None,
        cached_prompt_tokens: int | None = None,
    ) -> Episode:
        """A finished episode (record it after its artifacts are durable); `artifact_sha256` maps names of
        `artifacts` to the SHA-256 each was published with.

        Key: (cycle, task, kind, version, candidate, seed, attempt, generation). A retry after an infrastructure
        failure is a new `attempt` pointing at the failed one through `retry_of_id`. Recording an existing key
        with another prompt hash raises UnitConflictError (the prompt must not change under a unit).
        """
        kind = _member(EpisodeKind, kind, "episode kind")
        task = _task(task_id)
        unit_key = episode_unit_key(
            task_id=task,
            kind=kind,
            seed=seed,
            attempt=attempt,
            version=version,
            candidate=candidate,
            generation=generation,
        )
        started_at = _aware(started_at, "episode started_at")
        finished_at = _aware(finished_at, "episode finished_at")
        if duration_s is None and started_at is not None and finished_at is not None:
            duration_s = (finished_at - started_at).total_seconds()
        values = {
            "task_id": task,
            "kind": kind,
            "version": version,
            "candidate": candidate,
            "generation": generation,
            "seed": seed,
            "attempt": attempt,
            "condition": condition,
            "model": model,
            "status": _member(EpisodeStatus, status, "episode status"),
            "exit_code": exit_code,
            "failure": _document(failure, "episode failure"),
            "prompt_sha256": prompt_sha256,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "requests": requests,
            "max_prompt_tokens": max_prompt_tokens,
            "started_at": started_at,
            "finished_at": finished_at,
            "duration_s": duration_s,
            "artifacts": _document(artifacts, "episode artifacts"),
            "qwen_code_version": qwen_code_version,
            "retry_of_id": retry_of_id,
            "artifact_sha256": _hashes(artifact_sha256, artifacts, "episode artifact_sha256"),
            "cached_prompt_tokens": cached_prompt_tokens,
        }
        return self._record(
            Episode, {"cycle_id": cycle_id, "unit_key": unit_key}, values, must_match=("prompt_sha256",)
        )

    def get_episode(self, episode_id: int) -> Episode | None:
        with self.store.read() as session:
            return session.get(Episode, episode_id)

    def episodes(
        self,
        cycle_id: int,
        *,
        task_id: TaskId | None = None,
        kind: str | None = None,
        status: str | None = None,
        generation: str | None = None,
    ) -> list[Episode]:
        """Episodes of a cycle, optionally filtered, in recording order."""
        statement = sa.select(Episode).where(Episode.cycle_id == cycle_id).order_by(Episode.id)
        if task_id is not None:
            statement = statement.where(Episode.task_id == _task(task_id))
        if kind is not None:
            statement = statement.where(Episode.kind == _member(EpisodeKind, kind, "episode kind"))
        if status is not None:
            statement = statement.where(Episode.status == _member(EpisodeStatus, status, "episode status"))
        if generation is not None:
            statement = statement.where(Episode.generation == generation)
        return self._all(statement)

    def completed_episodes(
        self, cycle_id: int, task_id: TaskId, kind: str, *, generation: str | None = None
    ) -> list[Episode]:
        """Succeeded episodes of one task and kind (the ones ranking, selection and reports may use)."""
        return self.episodes(
            cycle_id, task_id=task_id, kind=kind, status=EpisodeStatus.SUCCEEDED, generation=generation
        )

    def episode_attempts(
        self,
        cycle_id: int,
        *,
        task_id: TaskId,
        kind: str,
        seed: int,
        version: int | None = None,
        candidate: int | None = None,
        generation: str | None = None,
    ) -> list[Episode]:
        """Every recorded attempt of one episode unit, first attempt first (decides skip / retry / next attempt)."""
        statement = (
            sa.select(Episode)
            .where(
                Episode.cycle_id == cycle_id,
                Episode.task_id == _task(task_id),
                Episode.kind == _member(EpisodeKind, kind, "episode kind"),
                Episode.seed == seed,
                Episode.version.is_(None) if version is None else Episode.version == version,
                Episode.candidate.is_(None) if candidate is None else Episode.candidate == candidate,
                Episode.generation.is_(None) if generation is None else Episode.generation == generation,
            )
            .order_by(Episode.attempt)
        )
        return self._all(statement)

    def episode_usage(self, cycle_id: int) -> list[UsageTotal]:
        """Agent token usage of a cycle per episode kind."""
        statement = (
            sa.select(
                Episode.kind,
                sa.func.count(),
                sa.func.coalesce(sa.func.sum(Episode.prompt_tokens), 0),
                sa.func.coalesce(sa.func.sum(Episode.completion_tokens), 0),
            )
            .where(Episode.cycle_id == cycle_id)
            .group_by(Episode.kind)
            .order_by(Episode.kind)
        )
        with self.store.read() as session:
            rows = session.execute(statement).all()
        return [UsageTotal(kind, int(n), int(p), int(c), None) for kind, n, p, c in rows]

    # -- LLM calls and comparisons -------------------------------------------------------------------------------

    def record_llm_call(
        self,
        cycle_id: int,
        unit_key: str,
        *,
        purpose: str,
        model: str,
        status: str = CallStatus.SUCCEEDED,
        task_id: TaskId | None = None,
        provider: str | None = None,
        seed: int | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        usage: Mapping[str, Any] | None = None,
        cost_usd: float | None = None,
        latency_s: float | None = None,
        prompt_uri: str | None = None,
        result_uri: str | None = None,
        error: str | None = None,
        prompt_sha256: str | None = None,
        result_sha256: str | None = None,
        cached_prompt_tokens: int | None = None,
    ) -> LLMCall:
        """One judge / optimizer / arbitration call, keyed by a caller-chosen `unit_key` unique in the cycle."""
        values = {
            "purpose": _member(CallPurpose, purpose, "LLM call purpose"),
            "model": model,
            "status": _member(CallStatus, status, "LLM call status"),
            "task_id": _task(task_id) if task_id is not None else None,
            "provider": provider,
            "seed": seed,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "usage": _document(usage, "usage"),
            "cost_usd": cost_usd,
            "latency_s": latency_s,
            "prompt_uri": prompt_uri,
            "result_uri": result_uri,
            "error": error,
            "prompt_sha256": _sha256(prompt_sha256, "LLM call prompt_sha256"),
            "result_sha256": _sha256(result_sha256, "LLM call result_sha256"),
            "cached_prompt_tokens": cached_prompt_tokens,
        }
        return self._record(
            LLMCall, {"cycle_id": cycle_id, "unit_key": unit_key}, values, must_match=("purpose", "model")
        )

    def get_llm_call(self, cycle_id: int, unit_key: str) -> LLMCall | None:
        return self._one(sa.select(LLMCall).where(LLMCall.cycle_id == cycle_id, LLMCall.unit_key == unit_key))

    def get_llm_calls(self, cycle_id: int, unit_keys: Sequence[str]) -> dict[str, LLMCall]:
        """The recorded calls among `unit_keys`, by key (absent keys are missing): one query for many lookups."""
        if not unit_keys:
            return {}
        statement = sa.select(LLMCall).where(LLMCall.cycle_id == cycle_id, LLMCall.unit_key.in_(list(unit_keys)))
        return {row.unit_key: row for row in self._all(statement)}

    def llm_calls(self, cycle_id: int, *, purpose: str | None = None) -> list[LLMCall]:
        statement = sa.select(LLMCall).where(LLMCall.cycle_id == cycle_id).order_by(LLMCall.id)
        if purpose is not None:
            statement = statement.where(LLMCall.purpose == _member(CallPurpose, purpose, "LLM call purpose"))
        return self._all(statement)

    def llm_usage(self, cycle_id: int) -> list[UsageTotal]:
        """Tokens and cost of a cycle's LLM calls per purpose (cost None when no call of the group reported one)."""
        statement = (
            sa.select(
                LLMCall.purpose,
                sa.func.count(),
                sa.func.coalesce(sa.func.sum(LLMCall.prompt_tokens), 0),
                sa.func.coalesce(sa.func.sum(LLMCall.completion_tokens), 0),
                sa.func.sum(LLMCall.cost_usd),
            )
            .where(LLMCall.cycle_id == cycle_id)
            .group_by(LLMCall.purpose)
            .order_by(LLMCall.purpose)
        )
        with self.store.read() as session:
            rows = session.execute(statement).all()
        return [
            UsageTotal(purpose, int(n), int(p), int(c), float(cost) if cost is not None else None)
            for purpose, n, p, c, cost in rows
        ]

    def record_comparison(
        self,
        cycle_id: int,
        task_id: TaskId,
        ledger: str,
        key: str,
        *,
        side_a: str,
        side_b: str,
        judge_model: str,
        verdict: str,
        episode_a_id: int | None = None,
        episode_b_id: int | None = None,
        judge_provider: str | None = None,
        seed: int | None = None,
        swapped: bool = False,
        rationale: str | None = None,
        rationale_uri: str | None = None,
        llm_call_id: int | None = None,
        usage: Mapping[str, Any] | None = None,
        rationale_sha256: str | None = None,
    ) -> Comparison:
        """One judged pair in a ledger; `verdict` is in the A/B orientation of `side_a`/`side_b` (after any swap)."""
        row_key = {
            "cycle_id": cycle_id,
            "task_id": _task(task_id),
            "ledger": _member(Ledger, ledger, "ledger"),
            "key": key,
        }
        values = {
            "side_a": side_a,
            "side_b": side_b,
            "episode_a_id": episode_a_id,
            "episode_b_id": episode_b_id,
            "judge_model": judge_model,
            "judge_provider": judge_provider,
            "seed": seed,
            "swapped": swapped,
            "verdict": _member(Verdict, verdict, "verdict"),
            "rationale": rationale,
            "rationale_uri": rationale_uri,
            "llm_call_id": llm_call_id,
            "usage": _document(usage, "usage"),
            "rationale_sha256": _sha256(rationale_sha256, "comparison rationale_sha256"),
        }
        return self._record(
            Comparison, row_key, values, must_match=("side_a", "side_b", "episode_a_id", "episode_b_id")
        )

    def get_comparison(self, cycle_id: int, task_id: TaskId, ledger: str, key: str) -> Comparison | None:
        return self._one(
            sa.select(Comparison).where(
                Comparison.cycle_id == cycle_id,
                Comparison.task_id == _task(task_id),
                Comparison.ledger == _member(Ledger, ledger, "ledger"),
                Comparison.key == key,
            )
        )

    def comparisons(self, cycle_id: int, ledger: str, *, task_id: TaskId | None = None) -> list[Comparison]:
        """A ledger in recording order (the order the reference release appends its JSONL ledgers)."""
        statement = (
            sa.select(Comparison)
            .where(Comparison.cycle_id == cycle_id, Comparison.ledger == _member(Ledger, ledger, "ledger"))
            .order_by(Comparison.id)
        )
        if task_id is not None:
            statement = statement.where(Comparison.task_id == _task(task_id))
        return self._all(statement)

    def task_comparisons(self, cycle_id: int, task_id: TaskId, ledgers: Sequence[str]) -> list[Comparison]:
        """One task's rows of several ledgers in recording order (one query where `comparisons` would take one per
        ledger)."""
        names = [_member(Ledger, ledger, "ledger") for ledger in ledgers]
        statement = (
            sa.select(Comparison)
            .where(
                Comparison.cycle_id == cycle_id,
                Comparison.task_id == _task(task_id),
                Comparison.ledger.in_(names),
            )
            .order_by(Comparison.id)
        )
        return self._all(statement)

    # -- ranking and selection -----------------------------------------------------------------------------------

    def record_ranking(
        self,
        cycle_id: int,
        episode_id: int,
        *,
        score: float,
        rank: int,
        ci_low: float | None = None,
        ci_high: float | None = None,
    ) -> Ranking:
        """Score and rank of a collected episode; its task is taken from the episode."""
        with self.store.write() as session:
            episode = self._episode_of_cycle(session, cycle_id, episode_id)
            values = {
                "cycle_id": cycle_id,
                "task_id": episode.task_id,
                "score": score,
                "rank": rank,
                "ci_low": ci_low,
                "ci_high": ci_high,
            }
            return self._insert_once(session, Ranking, {"episode_id": episode_id}, values, must_match=("rank",))

    def rankings(self, cycle_id: int, task_id: TaskId) -> list[Ranking]:
        """A task's ranking, rank 1 (best) first."""
        return self._all(
            sa.select(Ranking)
            .where(Ranking.cycle_id == cycle_id, Ranking.task_id == _task(task_id))
            .order_by(Ranking.rank)
        )

    def record_selection(
        self, cycle_id: int, episode_id: int, split: str, *, rank: int | None = None, weight: float = 1.0
    ) -> Selection:
        """Select an episode for training or validation; an episode belongs to one split only."""
        with self.store.write() as session:
            episode = self._episode_of_cycle(session, cycle_id, episode_id)
            values = {
                "cycle_id": cycle_id,
                "task_id": episode.task_id,
                "split": _member(DataSplit, split, "data split"),
                "rank": rank,
                "weight": weight,
            }
            return self._insert_once(session, Selection, {"episode_id": episode_id}, values, must_match=("split",))

    def selections(self, cycle_id: int, split: str) -> list[Selection]:
        return self._all(
            sa.select(Selection)
            .where(Selection.cycle_id == cycle_id, Selection.split == _member(DataSplit, split, "data split"))
            .order_by(Selection.task_id, Selection.rank, Selection.id)
        )

    # -- datasets and windows ------------------------------------------------------------------------------------

    def record_dataset(
        self,
        cycle_id: int,
        split: str,
        uri: str,
        *,
        episodes: int,
        windows: int,
        loss_tokens: int,
        total_tokens: int,
        stats: Mapping[str, Any] | None = None,
        tokenizer: str | None = None,
    ) -> Dataset:
        key = {"cycle_id": cycle_id, "split": _member(DataSplit, split, "data split")}
        values = {
            "uri": uri,
            "episodes": episodes,
            "windows": windows,
            "loss_tokens": loss_tokens,
            "total_tokens": total_tokens,
            "stats": _document(stats, "dataset stats"),
            "tokenizer": tokenizer,
        }
        return self._record(Dataset, key, values, must_match=("uri",))

    def get_dataset(self, cycle_id: int, split: str) -> Dataset | None:
        return self._one(
            sa.select(Dataset).where(
                Dataset.cycle_id == cycle_id, Dataset.split == _member(DataSplit, split, "data split")
            )
        )

    def record_windows(self, dataset_id: int, windows: Iterable[Mapping[str, Any]]) -> int:
        """Index a dataset's windows in one transaction; windows already indexed (same position) are skipped.

        Each mapping carries the `TrainingWindow` columns (position, task_id, role, is_main, window_index,
        n_windows, n_tokens, n_loss_tokens; optional episode_id, thread, segment, weight). Returns how many windows
        the dataset has indexed afterwards.
        """
        rows: list[dict[str, Any]] = []
        for index, window in enumerate(windows):
            unknown = set(window) - WINDOW_FIELDS
            if unknown:
                raise InvalidRecordError(
                    f"window #{index} of dataset {dataset_id} has unknown fields {sorted(unknown)}"
                )
            row = {"episode_id": None, "thread": None, "segment": None, "weight": 1.0, **window}
            row["dataset_id"] = dataset_id
            row["task_id"] = _task(row["task_id"])
            row["role"] = _member(WindowRole, row["role"], f"window #{index} role")
            rows.append(row)
        # One lock order for every writer: two renders indexing overlapping windows in different orders would
        # otherwise deadlock on Postgres' unique index.
        rows.sort(key=lambda row: row["position"])
        count = sa.select(sa.func.count()).select_from(TrainingWindow).where(TrainingWindow.dataset_id == dataset_id)
        with self.store.write() as session:
            if rows:
                statement = self._dialect_insert(TrainingWindow).on_conflict_do_nothing(
                    index_elements=["dataset_id", "position"]
                )
                try:
                    session.execute(statement, rows)
                except sa.exc.IntegrityError as exc:
                    reason = str(exc.orig).strip().splitlines()[0]
                    raise InvalidRecordError(f"training_windows of dataset {dataset_id}: {reason}") from None
            return int(session.scalar(count) or 0)

    def windows(
        self, dataset_id: int, *, task_id: TaskId | None = None, role: str | None = None
    ) -> list[TrainingWindow]:
        statement = (
            sa.select(TrainingWindow).where(TrainingWindow.dataset_id == dataset_id).order_by(TrainingWindow.position)
        )
        if task_id is not None:
            statement = statement.where(TrainingWindow.task_id == _task(task_id))
        if role is not None:
            statement = statement.where(TrainingWindow.role == _member(WindowRole, role, "window role"))
        return self._all(statement)

    def window_groups(self, dataset_id: int) -> list[WindowGroup]:
        """Window and loss-token counts per (task, role) of a dataset."""
        statement = (
            sa.select(
                TrainingWindow.task_id,
                TrainingWindow.role,
                sa.func.count(),
                sa.func.coalesce(sa.func.sum(TrainingWindow.n_loss_tokens), 0),
            )
            .where(TrainingWindow.dataset_id == dataset_id)
            .group_by(TrainingWindow.task_id, TrainingWindow.role)
            .order_by(TrainingWindow.task_id, TrainingWindow.role)
        )
        with self.store.read() as session:
            rows = session.execute(statement).all()
        return [WindowGroup(task, role, int(n), int(loss)) for task, role, n, loss in rows]

    # -- training ------------------------------------------------------------------------------------------------

    def ensure_training_run(self, cycle_id: int, key: str, args: Mapping[str, Any]) -> TrainingRun:
        """The training run `key` of a cycle, created on first call; other `args` under the same key conflict."""
        values = {"args": _document(args, "training args"), "status": RunStatus.PENDING.value, "created_at": utcnow()}
        return self._record(TrainingRun, {"cycle_id": cycle_id, "key": key}, values, must_match=("args",))

    def set_training_run_status(
        self,
        run_id: int,
        status: str,
        *,
        log_uri: str | None = None,
        output_uri: str | None = None,
        log_sha256: str | None = None,
    ) -> TrainingRun:
        """Move a run to `status`; running stamps `started_at` once, finishing states stamp `finished_at`.
        `log_sha256` is the hash the log at `log_uri` was published with."""
        status = _member(RunStatus, status, "training run status")
        log_sha256 = _sha256(log_sha256, "training run log_sha256")
        with self.store.write() as session:
            run = session.get(TrainingRun, run_id)
            if run is None:
                raise InvalidRecordError(f"training run {run_id} does not exist")
            run.status = status
            now = utcnow()
            if status == RunStatus.RUNNING and run.started_at is None:
                run.started_at = now
            if status in (RunStatus.SUCCEEDED, RunStatus.FAILED):
                run.finished_at = now
            if log_uri is not None:
                run.log_uri = log_uri
                run.log_sha256 = log_sha256
            elif log_sha256 is not None:
                run.log_sha256 = log_sha256
            if output_uri is not None:
                run.output_uri = output_uri
            return run

    def record_checkpoint(
        self,
        run_id: int,
        step: int,
        *,
        uri: str | None = None,
        train_loss: float | None = None,
        val_loss: float | None = None,
        val_tokens: int | None = None,
        sha256: str | None = None,
    ) -> Checkpoint:
        """A step's adapter (`uri`, published with `sha256`) and/or validation result. Later calls for the same
        step fill fields still empty, so a checkpoint save and the validation at that step may be recorded in
        either order; a different value for a filled field raises UnitConflictError.
        """
        given = {
            "uri": uri,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "val_tokens": val_tokens,
            "sha256": _sha256(sha256, "checkpoint sha256"),
        }
        with self.store.write() as session:
            checkpoint = self._insert_once(
                session, Checkpoint, {"run_id": run_id, "step": step}, given, must_match=tuple(given)
            )
            for field, value in given.items():
                if value is not None and getattr(checkpoint, field) is None:
                    setattr(checkpoint, field, value)
            return checkpoint

    def checkpoints(self, run_id: int) -> list[Checkpoint]:
        return self._all(sa.select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step))

    def best_checkpoint(self, run_id: int) -> Checkpoint | None:
        """The saved checkpoint with the lowest validation loss, ties to the earlier step; step 0 never counts."""
        return self._one(
            sa.select(Checkpoint)
            .where(
                Checkpoint.run_id == run_id,
                Checkpoint.step > 0,
                Checkpoint.uri.is_not(None),
                Checkpoint.val_loss.is_not(None),
            )
            .order_by(Checkpoint.val_loss, Checkpoint.step)
            .limit(1)
        )

    # -- model generations and evaluations -----------------------------------------------------------------------

    def register_generation(
        self,
        name: str,
        generation: int,
        *,
        bf16_uri: str,
        fp8_uri: str | None = None,
        parent_id: int | None = None,
        cycle_id: int | None = None,
        checkpoint_id: int | None = None,
        served_name: str | None = None,
        lineage: Mapping[str, Any] | None = None,
        bf16_sha256: str | None = None,
        fp8_sha256: str | None = None,
    ) -> ModelGeneration:
        """Register model `name` (L0 base: no parent/cycle). Re-registering with other weights or parent conflicts.

        `bf16_sha256` / `fp8_sha256`: SHA-256 of each model's ``manifest.json`` (`ModelManifest.digest`'s bytes as
        stored), which pins every file of the model.
        """
        values = {
            "generation": generation,
            "bf16_uri": bf16_uri,
            "fp8_uri": fp8_uri,
            "parent_id": parent_id,
            "cycle_id": cycle_id,
            "checkpoint_id": checkpoint_id,
            "served_name": served_name,
            "lineage": _document(lineage, "lineage"),
            "registered_at": utcnow(),
            "bf16_sha256": _sha256(bf16_sha256, "model bf16_sha256"),
            "fp8_sha256": _sha256(fp8_sha256, "model fp8_sha256"),
        }
        return self._record(
            ModelGeneration,
            {"name": name},
            values,
            must_match=("generation", "bf16_uri", "fp8_uri", "parent_id", "bf16_sha256", "fp8_sha256"),
        )

    def get_generation(self, name: str) -> ModelGeneration | None:
        return self._one(sa.select(ModelGeneration).where(ModelGeneration.name == name))

    def latest_generation(self) -> ModelGeneration | None:
        """The highest generation registered (the latest registration among equals)."""
        return self._one(
            sa.select(ModelGeneration)
            .order_by(
                ModelGeneration.generation.desc(), ModelGeneration.registered_at.desc(), ModelGeneration.id.desc()
            )
            .limit(1)
        )

    def lineage(self, generation_id: int) -> list[ModelGeneration]:
        """The generation and its ancestors, newest first, down to the base model (one recursive query)."""
        chain = (
            sa.select(ModelGeneration.id, ModelGeneration.parent_id, sa.literal(0).label("depth"))
            .where(ModelGeneration.id == generation_id)
            .cte("chain", recursive=True)
        )
        parent = aliased(ModelGeneration)
        chain = chain.union_all(
            sa.select(parent.id, parent.parent_id, (chain.c.depth + 1).label("depth")).join(
                chain, parent.id == chain.c.parent_id
            )
        )
        statement = sa.select(ModelGeneration).join(chain, ModelGeneration.id == chain.c.id).order_by(chain.c.depth)
        return self._all(statement)

    def record_evaluation(
        self,
        key: str,
        kind: str,
        *,
        generation_id: int,
        results: Mapping[str, Any],
        baseline_generation_id: int | None = None,
        cycle_id: int | None = None,
        results_uri: str | None = None,
        results_sha256: str | None = None,
    ) -> Evaluation:
        """A finished evaluation; `results_sha256` is the hash the document at `results_uri` was published with."""
        values = {
            "kind": kind,
            "generation_id": generation_id,
            "baseline_generation_id": baseline_generation_id,
            "cycle_id": cycle_id,
            "results": _document(results, "evaluation results"),
            "results_uri": results_uri,
            "results_sha256": _sha256(results_sha256, "evaluation results_sha256"),
        }
        return self._record(
            Evaluation, {"key": key}, values, must_match=("kind", "generation_id", "baseline_generation_id")
        )

    def evaluations(self, *, generation_id: int | None = None, kind: str | None = None) -> list[Evaluation]:
        statement = sa.select(Evaluation).order_by(Evaluation.id)
        if generation_id is not None:
            statement = statement.where(
                sa.or_(Evaluation.generation_id == generation_id, Evaluation.baseline_generation_id == generation_id)
            )
        if kind is not None:
            statement = statement.where(Evaluation.kind == kind)
        return self._all(statement)

    # -- budgets -------------------------------------------------------------------------------------------------

    def add_budget_spend(
        self,
        cycle_id: int,
        scopes: Sequence[str],
        *,
        tokens: int,
        cost_usd: float = 0.0,
        requests: int = 1,
        charge_key: str | None = None,
    ) -> bool:
        """Add spend to every scope of `scopes` in one transaction: an atomic increment (INSERT … ON CONFLICT DO
        UPDATE SET x = x + excluded.x), so concurrent processes never lose one another's spend.

        With `charge_key`, the charge is made at most once per cycle: its marker (`budget_charges`) commits with the
        increments, and a key already marked adds nothing. Returns whether the spend was added."""
        if not scopes:
            return False
        table = BudgetSpend.__table__
        insert = self._dialect_insert(BudgetSpend)
        statement = insert.on_conflict_do_update(
            index_elements=["cycle_id", "scope"],
            set_={
                "tokens": table.c.tokens + insert.excluded.tokens,
                "cost_usd": table.c.cost_usd + insert.excluded.cost_usd,
                "requests": table.c.requests + insert.excluded.requests,
                "updated_at": insert.excluded.updated_at,
            },
        )
        now = utcnow()
        rows = [
            {
                "cycle_id": cycle_id,
                "scope": scope,
                "tokens": tokens,
                "cost_usd": cost_usd,
                "requests": requests,
                "updated_at": now,
            }
            for scope in dict.fromkeys(scopes)
        ]
        with self.store.transaction() as connection:
            if charge_key is not None:
                mark = (
                    self._dialect_insert(BudgetCharge)
                    .on_conflict_do_nothing(index_elements=["cycle_id", "charge_key"])
                    .returning(BudgetCharge.id)  # no row back: the key was there (rowcount is not portable here)
                )
                marked = connection.execute(mark, {"cycle_id": cycle_id, "charge_key": charge_key, "created_at": now})
                if marked.first() is None:
                    return False  # charged before (a retried ingest): the increments are not repeated
            for row in rows:  # one statement per scope: executemany of an upsert is not portable
                connection.execute(statement, row)
        return True

    def note_budget_refusal(self, cycle_id: int, scope: str, need: int) -> None:
        """Remember that `scope` refused a request needing `need` tokens (its latest refusal)."""
        insert = self._dialect_insert(BudgetSpend)
        statement = insert.on_conflict_do_update(
            index_elements=["cycle_id", "scope"], set_={"refused_need": insert.excluded.refused_need}
        )
        row = {"cycle_id": cycle_id, "scope": scope, "tokens": 0, "cost_usd": 0.0, "requests": 0}
        with self.store.transaction() as connection:
            connection.execute(statement, {**row, "refused_need": need, "updated_at": utcnow()})

    def budget_spend(self, cycle_id: int, scopes: Sequence[str] | None = None) -> dict[str, BudgetSpend]:
        """Spend so far per scope of a cycle (all scopes, or those among `scopes`; absent ones spent nothing)."""
        statement = sa.select(BudgetSpend).where(BudgetSpend.cycle_id == cycle_id)
        if scopes is not None:
            statement = statement.where(BudgetSpend.scope.in_(list(scopes)))
        return {row.scope: row for row in self._all(statement)}

    # -- episode leases ------------------------------------------------------------------------------------------

    def start_episode_lease(
        self,
        cycle_id: int,
        *,
        task_id: TaskId,
        kind: str,
        seed: int,
        attempt: int,
        version: int | None = None,
        candidate: int | None = None,
        generation: str | None = None,
        host: str | None = None,
        started_at: datetime | None = None,
        renewed: bool = False,
    ) -> EpisodeLease:
        """Mark attempt `attempt` of the unit as started (upsert): the unit's lease, whatever attempt it named
        before, now names this one, started at `started_at` (default now) on `host`. `renewed`: its holder renews it
        (`renew_episode_lease`), so it lapses when renewals stop; else it lasts until ended or too old."""
        identity = {
            "task_id": _task(task_id),
            "kind": _member(EpisodeKind, kind, "kind"),
            "version": version,
            "candidate": candidate,
            "generation": generation,
        }
        key = {"cycle_id": cycle_id, "unit_key": episode_unit_slug(seed=seed, **identity)}
        values = {
            **identity,
            "attempt": attempt,
            "started_at": _aware(started_at, "started_at") or utcnow(),
            "host": host[:253] if host else None,
        }
        values["renewed_at"] = values["started_at"] if renewed else None
        insert = self._dialect_insert(EpisodeLease)
        statement = insert.on_conflict_do_update(
            index_elements=list(key), set_={name: getattr(insert.excluded, name) for name in values}
        ).returning(EpisodeLease)
        with self.store.write() as session:
            return session.scalars(statement, {**key, **values}).one()

    def renew_episode_lease(
        self,
        cycle_id: int,
        *,
        task_id: TaskId,
        kind: str,
        seed: int,
        attempt: int,
        version: int | None = None,
        candidate: int | None = None,
        generation: str | None = None,
    ) -> bool:
        """Renew the unit's lease if it still names attempt `attempt` (its holder is alive); whether it did."""
        unit_key = _lease_key(task_id, kind, seed, version, candidate, generation)
        statement = (
            sa.update(EpisodeLease)
            .where(
                EpisodeLease.cycle_id == cycle_id,
                EpisodeLease.unit_key == unit_key,
                EpisodeLease.attempt == attempt,
            )
            .values(renewed_at=utcnow())
        )
        with self.store.transaction() as connection:
            return bool(connection.execute(statement).rowcount)

    def end_episode_lease(
        self,
        cycle_id: int,
        *,
        task_id: TaskId,
        kind: str,
        seed: int,
        attempt: int | None = None,
        version: int | None = None,
        candidate: int | None = None,
        generation: str | None = None,
    ) -> bool:
        """Remove the unit's lease if it names attempt `attempt` or an earlier one (any attempt when None): a later
        attempt's lease stays. Returns whether a lease was removed."""
        unit_key = _lease_key(task_id, kind, seed, version, candidate, generation)
        statement = sa.delete(EpisodeLease).where(EpisodeLease.cycle_id == cycle_id, EpisodeLease.unit_key == unit_key)
        if attempt is not None:
            statement = statement.where(EpisodeLease.attempt <= attempt)
        with self.store.transaction() as connection:
            return bool(connection.execute(statement).rowcount)

    def episode_leases(self, cycle_id: int) -> list[EpisodeLease]:
        """Every lease of a cycle (fresh or not: `mass_ops.stages.leases` decides), in the order they were made."""
        return self._all(sa.select(EpisodeLease).where(EpisodeLease.cycle_id == cycle_id).order_by(EpisodeLease.id))

    # -- artifact references -------------------------------------------------------------------------------------

    def artifact_uris(self) -> dict[str, str | None]:
        """Every artifact URI a row points to, with the SHA-256 recorded for it (None where none was).

        Covers the URI columns of every table and the values of `Episode.artifacts`. A URI may name a prefix (a
        dataset's shards, a training run's output folder, a model folder): `mass_ops.store.gc` treats everything
        under it as referenced.
        """
        columns: list[tuple[Any, Any]] = [
            (LLMCall.prompt_uri, LLMCall.prompt_sha256),
            (LLMCall.result_uri, LLMCall.result_sha256),
            (WorkflowVersion.prompt_uri, WorkflowVersion.prompt_sha256),
            (Comparison.rationale_uri, Comparison.rationale_sha256),
            (Dataset.uri, sa.null()),
            (TrainingRun.log_uri, TrainingRun.log_sha256),
            (TrainingRun.output_uri, sa.null()),
            (Checkpoint.uri, Checkpoint.sha256),
            (ModelGeneration.bf16_uri, ModelGeneration.bf16_sha256),
            (ModelGeneration.fp8_uri, ModelGeneration.fp8_sha256),
            (Evaluation.results_uri, Evaluation.results_sha256),
        ]
        found: dict[str, str | None] = {}
        with self.store.read() as session:
            for uri_column, sha_column in columns:
                for uri, sha256 in session.execute(sa.select(uri_column, sha_column).where(uri_column.is_not(None))):
                    found[uri] = found.get(uri) or sha256
            rows = session.execute(
                sa.select(Episode.artifacts, Episode.artifact_sha256).where(Episode.artifacts.is_not(None))
            )
            for artifacts, hashes in rows:
                for name, uri in (artifacts or {}).items():
                    if isinstance(uri, str):
                        found[uri] = found.get(uri) or (hashes or {}).get(name)
        return found
