"""The floor of the repository: its errors, value checks and the session handling every aggregate shares.

`RepositoryBase._insert_once` is the idempotent write of one unit (``INSERT … ON CONFLICT DO NOTHING`` + a select
under the unique key, refusing a differing defining field); `_record`, `_one` and `_all` run a write or a read in
one session of the `MetadataStore` and return detached rows. Imports none of its sibling modules.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from mass_ops.errors import InputError
from mass_ops.store.metadata import MetadataStore
from mass_ops.store.schema import Base

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
        document: dict[str, Any] = json.loads(json.dumps(dict(value), allow_nan=False))
        return document
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


class RepositoryBase:
    """Session handling and the insert-once helper over one `MetadataStore` (the aggregates build on it)."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self._statement_cache: dict[tuple[type[Base], tuple[str, ...]], tuple[Any, Any]] = {}

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
            inserted: RowT | None = session.scalars(statement, {**key, **values}).one_or_none()
        except sa.exc.IntegrityError as exc:
            reason = str(exc.orig).strip().splitlines()[0]
            raise InvalidRecordError(f"{model.__tablename__} ({_describe(key)}): {reason}") from None
        if inserted is not None:  # new unit: RETURNING saved the read-back round trip
            return inserted
        row: RowT = session.scalars(select, {f"key_{name}": value for name, value in key.items()}).one()
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

    def _one(self, statement: sa.Select[RowT]) -> RowT | None:
        with self.store.read() as session:
            return session.scalars(statement).one_or_none()

    def _all(self, statement: sa.Select[Any]) -> list[Any]:
        with self.store.read() as session:
            return list(session.scalars(statement).all())
