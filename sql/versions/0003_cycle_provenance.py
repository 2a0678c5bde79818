"""Cycle provenance: what a cycle ran with beyond its config (the task catalogue's identity and file hashes, the
SHA-256 of every prompt template), one JSON document per cycle, keyed by kind.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    document = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
    op.add_column("cycles", sa.Column("provenance", document, nullable=True))


def downgrade() -> None:
    op.drop_column("cycles", "provenance")
