"""Charges made exactly once (ISSUE #15.2): `budget_charges` marks a keyed charge (a Kubernetes pod's episode attempt)
as added to `budget_spend`. The marker and the increments commit in one transaction, so an ingest retried after a
crash — between the attempt's row and its charge — charges once, and a second retry charges nothing.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "budget_charges",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=False),
        sa.Column("charge_key", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_budget_charges"),
        sa.ForeignKeyConstraint(
            ["cycle_id"], ["cycles.id"], name="fk_budget_charges_cycle_id_cycles", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("cycle_id", "charge_key", name="uq_budget_charges_cycle_id_charge_key"),
    )


def downgrade() -> None:
    op.drop_table("budget_charges")
