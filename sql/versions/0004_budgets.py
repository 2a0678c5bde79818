"""Budgets that hold (ISSUE #15.2) and prompt-cache hits (ISSUE #16.4).

- `budget_spend`: spend so far per (cycle, scope) — tokens, server-reported cost in USD, requests — incremented
  atomically by every process and pod of a cycle, read before each agent request and in-loop call.
- episode status `budget_exhausted`: the episode's proxy refused a request that would have crossed a budget.
- `cached_prompt_tokens` on episodes and llm_calls: `usage.prompt_tokens_details.cached_tokens` where reported.

SQLite cannot alter a CHECK constraint in place: the episodes table is rebuilt in batch mode (rows, indexes and
foreign keys are kept).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-10
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here, as in 0001: later model changes cannot alter what this revision did.
EPISODE_STATUS_BEFORE = ("succeeded", "model_failure", "infra_failure")
EPISODE_STATUS_AFTER = (*EPISODE_STATUS_BEFORE, "budget_exhausted")
# 0001 named the check "ck_episodes_status" and the metadata's naming convention prefixed it once more: that stored
# name is what is dropped; the new check is named the same way, so every revision leaves the same name behind.
STATUS_CHECK = "ck_episodes_status"
STATUS_CHECK_STORED = "ck_episodes_ck_episodes_status"


def _status_check(values: Sequence[str]) -> str:
    return "status IN ({})".format(", ".join(f"'{value}'" for value in values))


def upgrade() -> None:
    op.create_table(
        "budget_spend",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=False),
        sa.Column("scope", sa.String(80), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_usd", sa.Float(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("refused_need", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_budget_spend"),
        sa.ForeignKeyConstraint(
            ["cycle_id"], ["cycles.id"], name="fk_budget_spend_cycle_id_cycles", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("cycle_id", "scope", name="uq_budget_spend_cycle_id_scope"),
    )
    op.add_column("llm_calls", sa.Column("cached_prompt_tokens", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("episodes", recreate="auto") as batch:
        batch.add_column(sa.Column("cached_prompt_tokens", sa.BigInteger(), nullable=True))
        batch.drop_constraint(op.f(STATUS_CHECK_STORED), type_="check")
        batch.create_check_constraint(STATUS_CHECK, _status_check(EPISODE_STATUS_AFTER))


def downgrade() -> None:
    # Rows the older schema cannot hold go first: a budget-exhausted attempt becomes what a rerun would redo anyway.
    op.execute("DELETE FROM episodes WHERE status = 'budget_exhausted'")
    with op.batch_alter_table("episodes", recreate="auto") as batch:
        batch.drop_constraint(op.f(STATUS_CHECK_STORED), type_="check")
        batch.create_check_constraint(STATUS_CHECK, _status_check(EPISODE_STATUS_BEFORE))
        batch.drop_column("cached_prompt_tokens")
    op.drop_column("llm_calls", "cached_prompt_tokens")
    op.drop_table("budget_spend")
