"""Charges made exactly once and episode leases (ISSUE #15.2, #15.3).

`budget_charges` marks a keyed charge (a Kubernetes pod's episode attempt) as added to `budget_spend`. The marker and
the increments commit in one transaction, so an ingest retried after a crash — between the attempt's row and its
charge — charges once, and a second retry charges nothing.

`episode_leases` holds the episode attempts that have started and are not recorded yet (an episode's row is written
when its attempt ends), one per unit: what `mass-ops status` counts as in flight.

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

EPISODE_KINDS = ("reference", "search", "collection", "rollout", "benchmark")


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
    kinds = ", ".join(f"'{kind}'" for kind in EPISODE_KINDS)
    op.create_table(
        "episode_leases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=False),
        sa.Column("unit_key", sa.String(200), nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("candidate", sa.Integer(), nullable=True),
        sa.Column("generation", sa.String(64), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("host", sa.String(253), nullable=True),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_episode_leases"),
        sa.ForeignKeyConstraint(
            ["cycle_id"], ["cycles.id"], name="fk_episode_leases_cycle_id_cycles", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("cycle_id", "unit_key", name="uq_episode_leases_cycle_id_unit_key"),
        sa.CheckConstraint(f"kind IN ({kinds})", name="ck_episode_leases_kind"),
    )


def downgrade() -> None:
    op.drop_table("episode_leases")
    op.drop_table("budget_charges")
