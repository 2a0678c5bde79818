"""Artifact hashes: the SHA-256 of every artifact a row points to, recorded beside its URI.

Readers pass the recorded hash back to the artifact store (``get_bytes(key, sha256=...)``), so bytes changed after
publishing are refused even where the store's own record was lost. Nullable: rows written before this revision,
and URIs that name a prefix rather than one artifact, have none. For model generations the hash is that of the
model's ``manifest.json``, which lists the SHA-256 of every file.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, column, type): frozen here, as in 0001, so later model changes cannot alter what this revision did.
HASH_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("llm_calls", "prompt_sha256", "text"),
    ("llm_calls", "result_sha256", "text"),
    ("comparisons", "rationale_sha256", "text"),
    ("episodes", "artifact_sha256", "json"),
    ("training_runs", "log_sha256", "text"),
    ("checkpoints", "sha256", "text"),
    ("model_generations", "bf16_sha256", "text"),
    ("model_generations", "fp8_sha256", "text"),
    ("evaluations", "results_sha256", "text"),
)


def _type(kind: str) -> sa.types.TypeEngine:
    if kind == "json":
        return sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
    return sa.String(64)


def upgrade() -> None:
    for table, column, kind in HASH_COLUMNS:
        op.add_column(table, sa.Column(column, _type(kind), nullable=True))


def downgrade() -> None:
    # SQLite has dropped columns in place since 3.35; nothing here is indexed or constrained.
    for table, column, _kind in reversed(HASH_COLUMNS):
        op.drop_column(table, column)
