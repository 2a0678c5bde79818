"""Initial metadata schema: cycles, tasks, workflow versions, episodes, LLM calls, comparisons, rankings,
selections, datasets and windows, training runs and checkpoints, model generations and evaluations.

Written by hand and kept equal to `mass_ops.store.schema` (tests compare the migrated schema with the models).
Values of the CHECK constraints are frozen here on purpose: a later change of an enumeration is a new revision.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")


def _ts() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def _one_of(table: str, column: str, *values: str) -> sa.CheckConstraint:
    allowed = ", ".join(f"'{value}'" for value in values)
    return sa.CheckConstraint(f"{column} IN ({allowed})", name=f"ck_{table}_{column}")


def _fk(table: str, column: str, target: str, ondelete: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint([column], [f"{target}.id"], name=f"fk_{table}_{column}_{target}", ondelete=ondelete)


RUN_STATUS = ("pending", "running", "succeeded", "failed")
DATA_SPLIT = ("train", "val")


def upgrade() -> None:
    op.create_table(
        "cycles",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("preset", sa.String(64), nullable=True),
        sa.Column("parent_model", sa.String(256), nullable=True),
        sa.Column("config", _json(), nullable=False),
        sa.Column("config_hash", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", _ts(), nullable=False),
        sa.Column("updated_at", _ts(), nullable=False),
        sa.Column("finished_at", _ts(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_cycles"),
        sa.UniqueConstraint("name", name="uq_cycles_name"),
        _one_of("cycles", "status", *RUN_STATUS),
    )

    op.create_table(
        "cycle_tasks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("split", sa.String(8), nullable=False),
        sa.Column("excluded", sa.Boolean(), nullable=False),
        sa.Column("exclusion_reason", sa.Text(), nullable=True),
        sa.Column("bare_prompt_sha256", sa.String(64), nullable=True),
        sa.Column("initial_prompt_sha256", sa.String(64), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_cycle_tasks"),
        _fk("cycle_tasks", "cycle_id", "cycles", "CASCADE"),
        sa.UniqueConstraint("cycle_id", "task_id", name="uq_cycle_tasks_cycle_id_task_id"),
        _one_of("cycle_tasks", "split", "train", "test"),
    )

    op.create_table(
        "llm_calls",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=False),
        sa.Column("unit_key", sa.String(200), nullable=False),
        sa.Column("task_id", sa.String(64), nullable=True),
        sa.Column("purpose", sa.String(16), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("provider", sa.String(64), nullable=True),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=True),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=True),
        sa.Column("usage", _json(), nullable=True),
        sa.Column("cost_usd", sa.Float(), nullable=True),
        sa.Column("latency_s", sa.Float(), nullable=True),
        sa.Column("prompt_uri", sa.String(1024), nullable=True),
        sa.Column("result_uri", sa.String(1024), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_llm_calls"),
        _fk("llm_calls", "cycle_id", "cycles", "CASCADE"),
        sa.UniqueConstraint("cycle_id", "unit_key", name="uq_llm_calls_cycle_id_unit_key"),
        _one_of("llm_calls", "purpose", "judge", "optimizer", "self_judge", "external_judge", "arbitration"),
        _one_of("llm_calls", "status", "succeeded", "failed", "invalid"),
    )
    op.create_index("ix_llm_calls_cycle_id_purpose", "llm_calls", ["cycle_id", "purpose"])

    op.create_table(
        "workflow_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("parent_version", sa.Integer(), nullable=True),
        sa.Column("design", sa.Text(), nullable=False),
        sa.Column("diff", sa.Text(), nullable=True),
        sa.Column("prompt_uri", sa.String(1024), nullable=True),
        sa.Column("prompt_sha256", sa.String(64), nullable=True),
        sa.Column("proposal_call_id", sa.Integer(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_workflow_versions"),
        _fk("workflow_versions", "cycle_id", "cycles", "CASCADE"),
        _fk("workflow_versions", "proposal_call_id", "llm_calls", "SET NULL"),
        sa.UniqueConstraint("cycle_id", "task_id", "version", name="uq_workflow_versions_cycle_id_task_id_version"),
    )

    op.create_table(
        "episodes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=False),
        sa.Column("unit_key", sa.String(200), nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("candidate", sa.Integer(), nullable=True),
        sa.Column("generation", sa.String(64), nullable=True),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("condition", sa.String(128), nullable=True),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("failure", _json(), nullable=True),
        sa.Column("prompt_sha256", sa.String(64), nullable=True),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=True),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=True),
        sa.Column("requests", sa.Integer(), nullable=True),
        sa.Column("max_prompt_tokens", sa.BigInteger(), nullable=True),
        sa.Column("started_at", _ts(), nullable=True),
        sa.Column("finished_at", _ts(), nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("artifacts", _json(), nullable=True),
        sa.Column("qwen_code_version", sa.String(32), nullable=True),
        sa.Column("retry_of_id", sa.Integer(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_episodes"),
        _fk("episodes", "cycle_id", "cycles", "CASCADE"),
        _fk("episodes", "retry_of_id", "episodes", "SET NULL"),
        sa.UniqueConstraint("cycle_id", "unit_key", name="uq_episodes_cycle_id_unit_key"),
        _one_of("episodes", "kind", "reference", "search", "collection", "rollout", "benchmark"),
        _one_of("episodes", "status", "succeeded", "model_failure", "infra_failure"),
    )
    op.create_index("ix_episodes_cycle_id_task_id_kind_status", "episodes", ["cycle_id", "task_id", "kind", "status"])

    op.create_table(
        "comparisons",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("ledger", sa.String(16), nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("side_a", sa.String(128), nullable=False),
        sa.Column("side_b", sa.String(128), nullable=False),
        sa.Column("episode_a_id", sa.Integer(), nullable=True),
        sa.Column("episode_b_id", sa.Integer(), nullable=True),
        sa.Column("judge_model", sa.String(256), nullable=False),
        sa.Column("judge_provider", sa.String(64), nullable=True),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("swapped", sa.Boolean(), nullable=False),
        sa.Column("verdict", sa.String(8), nullable=False),
        sa.Column("rationale", sa.Text(), nullable=True),
        sa.Column("rationale_uri", sa.String(1024), nullable=True),
        sa.Column("llm_call_id", sa.Integer(), nullable=True),
        sa.Column("usage", _json(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_comparisons"),
        _fk("comparisons", "cycle_id", "cycles", "CASCADE"),
        _fk("comparisons", "episode_a_id", "episodes", "SET NULL"),
        _fk("comparisons", "episode_b_id", "episodes", "SET NULL"),
        _fk("comparisons", "llm_call_id", "llm_calls", "SET NULL"),
        sa.UniqueConstraint("cycle_id", "task_id", "ledger", "key", name="uq_comparisons_cycle_id_task_id_ledger_key"),
        _one_of("comparisons", "ledger", "rhi", "champion", "ranking", "external"),
        _one_of("comparisons", "verdict", "A", "B", "tie", "invalid"),
    )

    op.create_table(
        "retained_workflows",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("beats_reference", sa.Boolean(), nullable=False),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("last_evaluated_version", sa.Integer(), nullable=False),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_retained_workflows"),
        _fk("retained_workflows", "cycle_id", "cycles", "CASCADE"),
        sa.UniqueConstraint("cycle_id", "task_id", name="uq_retained_workflows_cycle_id_task_id"),
    )

    op.create_table(
        "rankings",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("episode_id", sa.Integer(), nullable=False),
        sa.Column("score", sa.Float(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("ci_low", sa.Float(), nullable=True),
        sa.Column("ci_high", sa.Float(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_rankings"),
        _fk("rankings", "cycle_id", "cycles", "CASCADE"),
        _fk("rankings", "episode_id", "episodes", "CASCADE"),
        sa.UniqueConstraint("episode_id", name="uq_rankings_episode_id"),
    )
    op.create_index("ix_rankings_cycle_id_task_id", "rankings", ["cycle_id", "task_id"])

    op.create_table(
        "selections",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("episode_id", sa.Integer(), nullable=False),
        sa.Column("split", sa.String(8), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_selections"),
        _fk("selections", "cycle_id", "cycles", "CASCADE"),
        _fk("selections", "episode_id", "episodes", "CASCADE"),
        sa.UniqueConstraint("episode_id", name="uq_selections_episode_id"),
        _one_of("selections", "split", *DATA_SPLIT),
    )
    op.create_index("ix_selections_cycle_id_split", "selections", ["cycle_id", "split"])

    op.create_table(
        "datasets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=False),
        sa.Column("split", sa.String(8), nullable=False),
        sa.Column("uri", sa.String(1024), nullable=False),
        sa.Column("tokenizer", sa.String(256), nullable=True),
        sa.Column("episodes", sa.Integer(), nullable=False),
        sa.Column("windows", sa.Integer(), nullable=False),
        sa.Column("loss_tokens", sa.BigInteger(), nullable=False),
        sa.Column("total_tokens", sa.BigInteger(), nullable=False),
        sa.Column("stats", _json(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_datasets"),
        _fk("datasets", "cycle_id", "cycles", "CASCADE"),
        sa.UniqueConstraint("cycle_id", "split", name="uq_datasets_cycle_id_split"),
        _one_of("datasets", "split", *DATA_SPLIT),
    )

    op.create_table(
        "training_windows",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("dataset_id", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("episode_id", sa.Integer(), nullable=True),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("is_main", sa.Boolean(), nullable=False),
        sa.Column("thread", sa.String(64), nullable=True),
        sa.Column("segment", sa.Integer(), nullable=True),
        sa.Column("window_index", sa.Integer(), nullable=False),
        sa.Column("n_windows", sa.Integer(), nullable=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("n_loss_tokens", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_training_windows"),
        _fk("training_windows", "dataset_id", "datasets", "CASCADE"),
        _fk("training_windows", "episode_id", "episodes", "SET NULL"),
        sa.UniqueConstraint("dataset_id", "position", name="uq_training_windows_dataset_id_position"),
        _one_of("training_windows", "role", "orchestrator", "worker", "auxiliary"),
    )
    op.create_index(
        "ix_training_windows_dataset_id_task_id_role", "training_windows", ["dataset_id", "task_id", "role"]
    )

    op.create_table(
        "training_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("args", _json(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("log_uri", sa.String(1024), nullable=True),
        sa.Column("output_uri", sa.String(1024), nullable=True),
        sa.Column("started_at", _ts(), nullable=True),
        sa.Column("finished_at", _ts(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_training_runs"),
        _fk("training_runs", "cycle_id", "cycles", "CASCADE"),
        sa.UniqueConstraint("cycle_id", "key", name="uq_training_runs_cycle_id_key"),
        _one_of("training_runs", "status", *RUN_STATUS),
    )

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("uri", sa.String(1024), nullable=True),
        sa.Column("train_loss", sa.Float(), nullable=True),
        sa.Column("val_loss", sa.Float(), nullable=True),
        sa.Column("val_tokens", sa.BigInteger(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoints"),
        _fk("checkpoints", "run_id", "training_runs", "CASCADE"),
        sa.UniqueConstraint("run_id", "step", name="uq_checkpoints_run_id_step"),
    )

    op.create_table(
        "model_generations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("cycle_id", sa.Integer(), nullable=True),
        sa.Column("checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("bf16_uri", sa.String(1024), nullable=False),
        sa.Column("fp8_uri", sa.String(1024), nullable=True),
        sa.Column("served_name", sa.String(256), nullable=True),
        sa.Column("lineage", _json(), nullable=True),
        sa.Column("registered_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_model_generations"),
        _fk("model_generations", "parent_id", "model_generations", "RESTRICT"),
        _fk("model_generations", "cycle_id", "cycles", "RESTRICT"),
        _fk("model_generations", "checkpoint_id", "checkpoints", "RESTRICT"),
        sa.UniqueConstraint("name", name="uq_model_generations_name"),
    )
    op.create_index("ix_model_generations_generation", "model_generations", ["generation"])

    op.create_table(
        "evaluations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("cycle_id", sa.Integer(), nullable=True),
        sa.Column("generation_id", sa.Integer(), nullable=False),
        sa.Column("baseline_generation_id", sa.Integer(), nullable=True),
        sa.Column("results", _json(), nullable=False),
        sa.Column("results_uri", sa.String(1024), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_evaluations"),
        _fk("evaluations", "cycle_id", "cycles", "SET NULL"),
        _fk("evaluations", "generation_id", "model_generations", "CASCADE"),
        _fk("evaluations", "baseline_generation_id", "model_generations", "CASCADE"),
        sa.UniqueConstraint("key", name="uq_evaluations_key"),
    )
    op.create_index("ix_evaluations_generation_id", "evaluations", ["generation_id"])


def downgrade() -> None:
    # Reverse creation order, so no table is dropped while another still references it.
    op.drop_index("ix_evaluations_generation_id", table_name="evaluations")
    op.drop_table("evaluations")
    op.drop_index("ix_model_generations_generation", table_name="model_generations")
    op.drop_table("model_generations")
    op.drop_table("checkpoints")
    op.drop_table("training_runs")
    op.drop_index("ix_training_windows_dataset_id_task_id_role", table_name="training_windows")
    op.drop_table("training_windows")
    op.drop_table("datasets")
    op.drop_index("ix_selections_cycle_id_split", table_name="selections")
    op.drop_table("selections")
    op.drop_index("ix_rankings_cycle_id_task_id", table_name="rankings")
    op.drop_table("rankings")
    op.drop_table("retained_workflows")
    op.drop_table("comparisons")
    op.drop_index("ix_episodes_cycle_id_task_id_kind_status", table_name="episodes")
    op.drop_table("episodes")
    op.drop_table("workflow_versions")
    op.drop_index("ix_llm_calls_cycle_id_purpose", table_name="llm_calls")
    op.drop_table("llm_calls")
    op.drop_table("cycle_tasks")
    op.drop_table("cycles")
