"""Schema migrations of the metadata database, driven through Alembic's API.

A database that cannot be reached fails within the store timeouts with one `StorageError` line
(`mass_ops.store.metadata`); a failing migration keeps its SQLAlchemy error and leaves the schema as it was.

The Alembic scripts live in the repository's ``sql/`` folder (found relative to this file); set
``MASS_MIGRATIONS_DIR`` to use another folder, e.g. in an image that copies ``sql/`` elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL

from mass_ops.errors import InputError
from mass_ops.store.metadata import MetadataStore

MIGRATIONS_DIR_ENV = "MASS_MIGRATIONS_DIR"
_MIGRATION_LOCK_ID = 0x6D6173735F6F7073 & 0x7FFFFFFFFFFFFFFF  # "mass_ops"; any constant shared by all deployers


class MigrationsNotFoundError(InputError):
    """The migrations folder is missing or is not an Alembic script folder."""


def migrations_dir() -> Path:
    """The Alembic script folder: ``$MASS_MIGRATIONS_DIR`` or ``<repo>/sql``."""
    configured = os.environ.get(MIGRATIONS_DIR_ENV)
    folder = Path(configured) if configured else Path(__file__).resolve().parents[2] / "sql"
    if not (folder / "env.py").is_file() or not (folder / "versions").is_dir():
        source = f"${MIGRATIONS_DIR_ENV}" if configured else "the repository"
        raise MigrationsNotFoundError(
            f"migrations folder {folder} (from {source}) has no env.py and versions/; "
            f"point {MIGRATIONS_DIR_ENV} at the sql/ folder of mass-ops"
        )
    return folder


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    return config


def head_revision() -> str | None:
    """The newest revision the scripts define."""
    return ScriptDirectory.from_config(_config()).get_current_head()


def _run(url: str | URL, action: str, revision: str) -> None:
    config = _config()
    # A migration's own SQL errors keep their types (the store's "run db upgrade" hint would be wrong here).
    store = MetadataStore(url, pool_size=1, max_overflow=0, schema_errors=False)
    try:
        # One transaction for the whole run (SQLite and Postgres both have transactional DDL): a failing
        # migration leaves the schema where it was. env.py picks the connection up from the attributes.
        with store.transaction() as connection:
            if store.dialect == "postgresql":
                # DDL on a big table and waiting for another deployer may both outlast the session statement
                # timeout, which is meant for the queries of a run; the connect timeout still bounds the start.
                connection.exec_driver_sql("SET LOCAL statement_timeout = 0")
                # Two deployers upgrading at once would both try to CREATE the same tables; the second now waits
                # and then finds the schema current. (SQLite: BEGIN IMMEDIATE already serialises them.)
                connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK_ID})")
            config.attributes["connection"] = connection
            if action == "upgrade":
                command.upgrade(config, revision)
            else:
                command.downgrade(config, revision)
    finally:
        store.dispose()


def upgrade(url: str | URL, revision: str = "head") -> None:
    """Create the schema or bring it up to `revision` (default: the newest). A no-op when already there."""
    _run(url, "upgrade", revision)


def downgrade(url: str | URL, revision: str) -> None:
    """Take the schema down to `revision`; ``"base"`` drops every table of the store."""
    _run(url, "downgrade", revision)


def current(url: str | URL) -> str | None:
    """The revision the database is at, or None for a database the migrations never touched."""
    store = MetadataStore(url, pool_size=1, max_overflow=0)
    try:
        with store.engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        store.dispose()
