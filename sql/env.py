"""Alembic environment of the mass-ops metadata schema.

Programmatic runs (`mass_ops.store.migrations`) hand over an open connection in ``config.attributes``. Command-line
runs (``alembic -c sql/alembic.ini upgrade head``) read the URL from ``$MASS_METADATA_URL`` or ``sqlalchemy.url``.
``--sql`` (offline mode) prints the DDL for a DBA instead of running it.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection

from mass_ops.store.metadata import MetadataStore, resolve_url
from mass_ops.store.schema import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = os.environ.get("MASS_METADATA_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("set MASS_METADATA_URL (or sqlalchemy.url in alembic.ini) to the metadata database")
    return url


def _migrate(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        # SQLite cannot ALTER most things in place; batch mode rebuilds the table when a later revision needs it.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    context.configure(url=resolve_url(_url()), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _migrate(connection)
        return
    store = MetadataStore(_url(), pool_size=1, max_overflow=0)
    try:
        with store.transaction() as connection:
            _migrate(connection)
    finally:
        store.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
