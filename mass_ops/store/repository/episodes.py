"""Episodes (one row per attempt of a unit) and the leases that mark an attempt as running."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from mass_ops.store.repository.base import (
    RepositoryBase,
    TaskId,
    UsageTotal,
    _aware,
    _document,
    _hashes,
    _member,
    _task,
)
from mass_ops.store.schema import (
    Episode,
    EpisodeKind,
    EpisodeLease,
    EpisodeStatus,
    episode_unit_key,
    episode_unit_slug,
    utcnow,
)


def _lease_key(
    task_id: TaskId, kind: str, seed: int, version: int | None, candidate: int | None, generation: str | None
) -> str:
    """The unit key a lease is stored under (the episode's unit key without its attempt)."""
    return episode_unit_slug(
        task_id=_task(task_id), kind=kind, seed=seed, version=version, candidate=candidate, generation=generation
    )


class EpisodeRecords(RepositoryBase):
    """Rows of `episodes` and `episode_leases`."""

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
        return [UsageTotal(kind, int(n), int(p or 0), int(c or 0), None) for kind, n, p, c in rows]

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
        task, member = _task(task_id), _member(EpisodeKind, kind, "kind")
        identity = {
            "task_id": task,
            "kind": member,
            "version": version,
            "candidate": candidate,
            "generation": generation,
        }
        key = {"cycle_id": cycle_id, "unit_key": _lease_key(task, member, seed, version, candidate, generation)}
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
            lease: EpisodeLease = session.scalars(statement, {**key, **values}).one()
            return lease

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
        """Every lease of a cycle (fresh or not: `mass_ops.ops.leases` decides), in the order they were made."""
        return self._all(sa.select(EpisodeLease).where(EpisodeLease.cycle_id == cycle_id).order_by(EpisodeLease.id))
