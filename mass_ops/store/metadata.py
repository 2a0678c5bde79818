"""Engine and session factory of the metadata database (SQLite embedded default, Postgres in production).

`MetadataStore(url)` owns one engine; `read()` and `write()` hand out short-lived sessions that roll back or commit
when the block ends, whose objects stay usable after it. Failures to reach the database are one-line `StorageError`s
(password masked); a missing table or column is `SchemaNotReadyError` (still an `OperationalError`) naming
`mass-ops db upgrade`; other SQL errors keep their SQLAlchemy types. Limits: `mass_ops.store.timeouts`.
SQLite runs in WAL mode, writers queue on ``BEGIN IMMEDIATE`` and an in-process lock. Why: docs/storage.md
(`mass_ops.store.metadata`).
"""

from __future__ import annotations

import importlib.util
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from mass_ops.errors import InputError
from mass_ops.store.errors import StorageError, storage_error
from mass_ops.store.timeouts import StoreTimeouts
from mass_ops.store.urls import mask_url

SQLITE_BUSY_TIMEOUT_MS = 60_000
_BEGIN_OPTION = "mass_ops_sqlite_begin"


STORE = "metadata store"
# SQLSTATE of a statement cancelled by statement_timeout (or by an operator).
_QUERY_CANCELED = "57014"
# SQLSTATEs of a statement naming a table or a column the database does not have (Postgres: undefined_table,
# undefined_column); SQLite says it in words.
_UNDEFINED_OBJECT = {"42P01": "table", "42703": "column"}
_SQLITE_UNDEFINED = ("no such table: ", "no such column: ")
UPGRADE_COMMAND = "mass-ops db upgrade"

__all__ = ["STORE", "MetadataStore", "MetadataURLError", "SchemaNotReadyError", "mask_url", "resolve_url"]


class MetadataURLError(InputError):
    """The metadata URL names no database this store supports."""


class SchemaNotReadyError(InputError, sa.exc.OperationalError):
    """The database lacks the mass-ops schema, or part of it: it was never migrated, or by an older mass-ops.

    An input error (exit 2: the command to run is named) whose text is one line, and still the SQLAlchemy error the
    driver's failure was (`OperationalError`), so callers that tolerate a failing store keep doing so."""

    def __init__(self, line: str, statement: str | None, params: Any, orig: BaseException | None) -> None:
        sa.exc.OperationalError.__init__(self, statement, params, orig)  # type: ignore[arg-type]
        self.line = line

    def __str__(self) -> str:
        return self.line

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.line, None, None, None))


def schema_not_ready(
    url: URL, original: BaseException, sqlstate: str | None, statement: str | None = None, params: Any = None
) -> SchemaNotReadyError | None:
    """The one-line `SchemaNotReadyError` for a driver error that names a missing table or column, else None."""
    missing = None
    if sqlstate in _UNDEFINED_OBJECT:
        named = re.search(r'"([^"]{1,80})"', str(original))  # relation "cycles" does not exist
        missing = f"{_UNDEFINED_OBJECT[sqlstate]} {named.group(1)}" if named else _UNDEFINED_OBJECT[sqlstate]
    else:
        text = str(original)
        for prefix in _SQLITE_UNDEFINED:
            if text.startswith(prefix):
                missing = f"{prefix.split()[-1].rstrip(':')} {text[len(prefix) :].split()[0]}"
    if missing is None:
        return None
    return SchemaNotReadyError(
        f"{STORE} {mask_url(url)} does not hold the mass-ops schema (no {missing}): it was never migrated, or by "
        f"an older mass-ops; run `{UPGRADE_COMMAND}` with the same --config/--set, then this command again",
        statement,
        params,
        original,
    )


def _postgres_driver() -> str:
    # Core installs ship psycopg2-binary; Airflow images also bring psycopg 3. Prefer 3 when both are present.
    if importlib.util.find_spec("psycopg") is not None:
        return "postgresql+psycopg"
    return "postgresql+psycopg2"


def resolve_url(url: str | URL) -> URL:
    """Parse and normalise a metadata URL: ``postgres://`` alias, default Postgres driver. Raises MetadataURLError."""
    try:
        parsed = make_url(url)
    except sa.exc.ArgumentError as exc:
        raise MetadataURLError(
            f"metadata URL {mask_url(url)!r} is not a database URL; use sqlite:///PATH or postgresql://HOST/DB"
        ) from exc
    backend = parsed.get_backend_name()
    if backend == "postgres":
        parsed = parsed.set(drivername="postgresql")
        backend = "postgresql"
    if backend not in {"sqlite", "postgresql"}:
        raise MetadataURLError(
            f"metadata URL {mask_url(parsed)!r} uses {backend!r}; only sqlite and postgresql are supported"
        )
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername=_postgres_driver())
    return parsed


class MetadataStore:
    """Connection to the metadata database.

    :param url: ``sqlite:///PATH`` (parent folder created on demand), ``sqlite://`` (in memory, one shared
        connection) or ``postgresql://USER@HOST:PORT/DB``.
    :param pool_size: Postgres connections kept open per process.
    :param max_overflow: extra Postgres connections allowed under load.
    :param echo: log every SQL statement (the URL's password is never logged).
    :param schema_errors: turn queries on missing tables or columns into `SchemaNotReadyError` (off for the
        migrations themselves, whose errors keep their SQLAlchemy types).

    Create the store after forking (one per process): engines and their pools do not survive ``fork``.
    """

    def __init__(
        self,
        url: str | URL,
        *,
        pool_size: int = 5,
        max_overflow: int = 10,
        echo: bool = False,
        timeouts: StoreTimeouts | None = None,
        schema_errors: bool = True,
    ) -> None:
        self.url = resolve_url(url)
        self._schema_errors = schema_errors
        self.dialect = self.url.get_backend_name()
        self.timeouts = timeouts or StoreTimeouts.from_env()
        if self.dialect == "sqlite":
            self.engine = self._sqlite_engine(echo)
        else:
            self.engine = self._postgres_engine(echo, pool_size, max_overflow)
        event.listen(self.engine, "handle_error", self._storage_failure)
        # Repository reads are single statements: on Postgres they run in autocommit, which saves the BEGIN and
        # ROLLBACK round trips of every query (half its latency for small lookups).
        read_engine = self.engine
        if self.dialect == "postgresql":
            read_engine = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self._reader = sessionmaker(read_engine, expire_on_commit=False, autoflush=False)
        self._write_engine = self.engine.execution_options(**{_BEGIN_OPTION: "IMMEDIATE"})
        self._writer = sessionmaker(self._write_engine, expire_on_commit=False, autoflush=False)
        # Reentrant, so a nested write in one thread behaves as before (it waits on SQLite, not on itself).
        self._write_lock: threading.RLock | None = threading.RLock() if self.dialect == "sqlite" else None

    def __repr__(self) -> str:
        return f"MetadataStore(url={mask_url(self.url)!r})"

    def _postgres_engine(self, echo: bool, pool_size: int, max_overflow: int) -> Engine:
        engine = sa.create_engine(
            self.url,
            echo=echo,
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_pre_ping=True,  # connections die with Postgres restarts and idle timeouts of proxies
            pool_recycle=1800,
            pool_timeout=self.timeouts.connect_s + self.timeouts.read_s,
            connect_args={"application_name": "mass-ops", **self.timeouts.postgres_connect_args()},
        )
        statement_ms = self.timeouts.statement_timeout_ms
        if statement_ms:

            @event.listens_for(engine, "connect")
            def _statement_timeout(dbapi_connection: Any, _record: Any) -> None:
                # A session setting rather than the "options" startup parameter, which PgBouncer refuses.
                cursor = dbapi_connection.cursor()
                cursor.execute(f"SET statement_timeout = {int(statement_ms)}")
                cursor.close()
                dbapi_connection.commit()  # the driver opened a transaction; a pool rollback would undo the SET

        return engine

    def _storage_failure(self, context: sa.engine.ExceptionContext) -> BaseException | None:
        """handle_error hook: connection-level failures become one-line `StorageError`s, a missing table or column
        `SchemaNotReadyError`; other SQL errors pass through.

        A failure while connecting (no connection yet), a lost connection (SQLAlchemy's disconnect detection) and a
        statement cancelled by the timeout are the store not answering; anything else is about the SQL and keeps
        its type. Pre-ping failures are left to the pool, which reconnects.
        """
        if context.is_pre_ping or isinstance(context.original_exception, StorageError):
            return None
        original = context.original_exception
        sqlstate = getattr(original, "sqlstate", None) or getattr(original, "pgcode", None)
        if context.connection is None:
            action = "connect"
        elif context.is_disconnect:
            action = "query (connection lost)"
        elif sqlstate == _QUERY_CANCELED:
            action = f"query (cancelled after the {self.timeouts.statement_s:g} s statement timeout)"
        else:
            if not self._schema_errors:
                return None
            return schema_not_ready(self.url, original, sqlstate, context.statement, context.parameters)
        return storage_error(action, STORE, self.url, original)

    def ping(self) -> None:
        """Run ``SELECT 1``: returns when the database answers, else raises `StorageError` (bounded by the timeouts)."""
        try:
            with self.engine.connect() as connection:
                connection.exec_driver_sql("SELECT 1").scalar_one()
        except StorageError:
            raise
        except sa.exc.DBAPIError as exc:
            raise storage_error("SELECT 1", STORE, self.url, exc.orig or exc) from exc

    def _sqlite_engine(self, echo: bool) -> Engine:
        database = self.url.database
        in_memory = database in (None, "", ":memory:")
        kwargs: dict[str, Any] = {"echo": echo}
        if in_memory or database is None:
            # Every connection to ":memory:" is a new, empty database: share one connection.
            kwargs.update(poolclass=StaticPool, connect_args={"check_same_thread": False})
        else:
            try:
                Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise storage_error("create the database folder", STORE, self.url, exc) from exc
            kwargs.update(connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
        engine = sa.create_engine(self.url, **kwargs)

        @event.listens_for(engine, "connect")
        def _configure(dbapi_connection: Any, _record: Any) -> None:
            # Take transaction control away from the sqlite3 module so BEGIN is ours (see _begin).
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            if not in_memory:
                _use_wal(cursor)
                cursor.execute("PRAGMA synchronous=NORMAL")  # durable with WAL except on power loss, much faster
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _begin(connection: sa.Connection) -> None:
            mode = connection.get_execution_options().get(_BEGIN_OPTION, "DEFERRED")
            connection.exec_driver_sql(f"BEGIN {mode}")

        return engine

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for queries. Never commits; on Postgres each statement sees the latest committed data (no
        snapshot spans two statements), on SQLite the block reads one snapshot.
        """
        with self._reader() as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A session whose work commits when the block ends, or rolls back if it raises."""
        with self._serialised_writes(), self._writer.begin() as session:
            yield session

    @contextmanager
    def transaction(self) -> Iterator[sa.Connection]:
        """A Core connection in a write transaction, committed when the block ends (rolled back if it raises)."""
        with self._serialised_writes(), self._write_engine.begin() as connection:
            yield connection

    @contextmanager
    def _serialised_writes(self) -> Iterator[None]:
        """Holds this process's SQLite writer lock for the block (no-op on Postgres, whose row locks suffice).

        A writer that waited the whole busy timeout goes ahead without it, so a writer stuck behind another fails
        on the database lock as it always did instead of hanging.
        """
        if self._write_lock is None:
            yield
            return
        acquired = self._write_lock.acquire(timeout=SQLITE_BUSY_TIMEOUT_MS / 1000)
        try:
            yield
        finally:
            if acquired:
                self._write_lock.release()

    def dispose(self) -> None:
        """Close every pooled connection (call before dropping the database or at process exit)."""
        self.engine.dispose()


def _use_wal(cursor: Any) -> None:
    """Put the SQLite file in WAL mode (a property of the file, set once). The switch needs the file to itself and
    SQLite answers "database is locked" at once, without its busy handler, while another connection writes — as
    when several processes open a new file and one is already migrating it — so wait for that, bounded by the busy
    timeout, re-reading the mode (another connection may have switched it meanwhile)."""
    import sqlite3
    import time

    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
