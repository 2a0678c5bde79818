"""Alembic migrations: empty → head → base → head on SQLite and Postgres, and head equals the models."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from mass_ops.store import migrations
from mass_ops.store.metadata import MetadataStore
from mass_ops.store.repository import MetadataRepository
from mass_ops.store.schema import Base

MODEL_TABLES = set(Base.metadata.tables)


def _tables(url: str) -> set[str]:
    store = MetadataStore(url)
    try:
        return set(sa.inspect(store.engine).get_table_names()) - {"alembic_version"}
    finally:
        store.dispose()


def _schema_diff(url: str, metadata: sa.MetaData) -> list[object]:
    store = MetadataStore(url)
    try:
        with store.engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return compare_metadata(context, metadata)
    finally:
        store.dispose()


def test_empty_to_head_to_base_to_head(metadata_url: str):
    assert migrations.current(metadata_url) is None
    assert _tables(metadata_url) == set()

    migrations.upgrade(metadata_url)
    assert migrations.current(metadata_url) == migrations.head_revision() == "0005"
    assert _tables(metadata_url) == MODEL_TABLES

    migrations.downgrade(metadata_url, "base")
    assert migrations.current(metadata_url) is None
    assert _tables(metadata_url) == set()

    migrations.upgrade(metadata_url, "head")
    assert migrations.current(metadata_url) == "0005"
    assert _tables(metadata_url) == MODEL_TABLES


def test_migrated_schema_equals_the_models(metadata_url: str):
    migrations.upgrade(metadata_url)
    assert _schema_diff(metadata_url, Base.metadata) == []

    # The comparison is sharp enough to notice a one-column type change and a missing index.
    altered = sa.MetaData(naming_convention=Base.metadata.naming_convention)
    for table in Base.metadata.sorted_tables:
        table.to_metadata(altered)
    altered.tables["episodes"].c.condition.type = sa.String(99)
    sa.Index("ix_episodes_extra", altered.tables["episodes"].c.seed)
    kinds = {str(diff[0][0] if isinstance(diff, list) else diff[0]) for diff in _schema_diff(metadata_url, altered)}
    assert kinds == {"modify_type", "add_index"}


def test_upgrade_is_a_no_op_on_a_current_schema_and_keeps_rows(metadata_url: str):
    migrations.upgrade(metadata_url)
    repo = MetadataRepository(MetadataStore(metadata_url))
    cycle = repo.ensure_cycle("keep", {"a": 1}, "0" * 64)
    repo.store.dispose()

    migrations.upgrade(metadata_url)
    repo = MetadataRepository(MetadataStore(metadata_url))
    assert repo.get_cycle("keep").id == cycle.id
    repo.store.dispose()


def test_concurrent_upgrades_do_not_collide(metadata_url: str):
    with ThreadPoolExecutor(max_workers=3) as pool:
        outcomes = list(pool.map(lambda _: migrations.upgrade(metadata_url), range(3)))
    assert outcomes == [None, None, None]
    assert migrations.current(metadata_url) == migrations.head_revision()
    assert _tables(metadata_url) == MODEL_TABLES


def test_a_failed_migration_leaves_the_schema_untouched(sqlite_url: str, tmp_path: Path, monkeypatch):
    scripts = tmp_path / "sql"
    shutil.copytree(migrations.migrations_dir(), scripts, ignore=shutil.ignore_patterns("__pycache__"))
    (scripts / "versions" / "9999_broken.py").write_text(
        '"""Broken on purpose."""\n'
        "import sqlalchemy as sa\nfrom alembic import op\n"
        f'revision = "9999"\ndown_revision = "{migrations.head_revision()}"\n'
        "branch_labels = None\ndepends_on = None\n\n"
        "def upgrade():\n"
        '    op.create_table("half_done", sa.Column("id", sa.Integer, primary_key=True))\n'
        '    op.execute("SELECT * FROM no_such_table")\n\n'
        "def downgrade():\n"
        "    pass\n"
    )
    monkeypatch.setenv(migrations.MIGRATIONS_DIR_ENV, str(scripts))
    assert migrations.head_revision() == "9999"
    with pytest.raises(sa.exc.OperationalError, match="no_such_table"):
        migrations.upgrade(sqlite_url)
    # Nothing of the run survived: neither the real revisions' tables nor the half-done broken one.
    assert migrations.current(sqlite_url) is None
    assert _tables(sqlite_url) == set()


def test_migrations_folder_comes_from_the_environment(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(migrations.MIGRATIONS_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(migrations.MigrationsNotFoundError, match="MASS_MIGRATIONS_DIR"):
        migrations.upgrade(f"sqlite:///{tmp_path / 'm.db'}")
    monkeypatch.delenv(migrations.MIGRATIONS_DIR_ENV)
    assert migrations.migrations_dir() == Path(__file__).resolve().parents[2] / "sql"


def test_a_query_on_an_unmigrated_database_is_one_line_naming_db_upgrade(metadata_url: str):
    from mass_ops.store.metadata import SchemaNotReadyError

    repository = MetadataRepository(MetadataStore(metadata_url))
    try:
        with pytest.raises(SchemaNotReadyError) as caught:
            repository.get_cycle("demo-L0")
        line = str(caught.value)
        assert "\n" not in line and "does not hold the mass-ops schema (no table cycles)" in line, line
        assert "run `mass-ops db upgrade`" in line
        assert isinstance(caught.value, sa.exc.OperationalError), "code that tolerates store failures still does"
        migrations.upgrade(metadata_url)  # the migrations' own queries are not turned into this error
        assert repository.get_cycle("demo-L0") is None
    finally:
        repository.store.dispose()
