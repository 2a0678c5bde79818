"""Declarative models of the metadata store (SQLAlchemy 2).

One row per unit of work. Every table carries a natural unique key, so recording the same unit twice can be a
no-op (see `repository.py`). Enumerations are stored as short strings guarded by CHECK constraints rather than
native Postgres enums: the same DDL runs on SQLite and Postgres, and adding a value later is a one-line migration.
The hand-written migrations `sql/versions/` must stay equal to this metadata; a test compares them.

Every column holding the URI of one artifact has a ``*sha256`` companion: the SHA-256 recorded when the artifact
was published, passed back to the artifact store on read (revision 0002). URIs of prefixes (a dataset's shards, a
training run's output) have none; their members' hashes live in the documents they index.

Task ids are text (`"51"`, `"sab_17"`) because benchmark tasks are named, not numbered.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mass_ops.layout import EpisodeUnit

NAMING_CONVENTION = {
    "pk": "pk_%(table_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
}


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (the only clock the store writes)."""
    return datetime.now(UTC)


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """Timezone-aware timestamps on both databases.

    SQLite has no time zone type and hands back naive values; they were written as UTC, so they are read as UTC.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError(f"timestamp {value.isoformat()} has no time zone; the store only accepts aware datetimes")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


# JSON documents: JSONB on Postgres (indexable, compact), JSON text elsewhere. None is stored as SQL NULL.
JSONDocument = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")


class EpisodeKind(enum.StrEnum):
    REFERENCE = "reference"
    SEARCH = "search"
    COLLECTION = "collection"
    ROLLOUT = "rollout"
    BENCHMARK = "benchmark"


class EpisodeStatus(enum.StrEnum):
    SUCCEEDED = "succeeded"
    MODEL_FAILURE = "model_failure"
    INFRA_FAILURE = "infra_failure"
    BUDGET_EXHAUSTED = "budget_exhausted"  # its proxy refused a request that would cross a budget (revision 0004)


class CallPurpose(enum.StrEnum):
    JUDGE = "judge"
    OPTIMIZER = "optimizer"
    SELF_JUDGE = "self_judge"
    EXTERNAL_JUDGE = "external_judge"
    ARBITRATION = "arbitration"


class CallStatus(enum.StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INVALID = "invalid"  # answered, but the answer failed parsing or schema validation


class Ledger(enum.StrEnum):
    RHI = "rhi"  # v_k vs the bare reference (comparison_history)
    CHAMPION = "champion"  # champion arbitration (champion_history)
    RANKING = "ranking"  # self-judged tournament matches
    EXTERNAL = "external"  # external judges for the report


class Verdict(enum.StrEnum):
    A = "A"
    B = "B"
    TIE = "tie"
    INVALID = "invalid"


class TaskSplit(enum.StrEnum):
    TRAIN = "train"
    TEST = "test"


class DataSplit(enum.StrEnum):
    TRAIN = "train"
    VAL = "val"


class WindowRole(enum.StrEnum):
    ORCHESTRATOR = "orchestrator"
    WORKER = "worker"
    AUXILIARY = "auxiliary"


class RunStatus(enum.StrEnum):
    """Lifecycle of a cycle or a training run."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


def one_of(column: str, values: type[enum.StrEnum]) -> sa.CheckConstraint:
    """CHECK constraint limiting `column` to an enumeration's values; named ck_<table>_<column>."""
    allowed = ", ".join(f"'{member.value}'" for member in values)
    return sa.CheckConstraint(f"{column} IN ({allowed})", name=column)


def episode_unit_key(
    *,
    task_id: str,
    kind: str,
    seed: int,
    attempt: int,
    version: int | None = None,
    candidate: int | None = None,
    generation: str | None = None,
) -> str:
    """The deterministic identity of one episode attempt within a cycle, e.g. ``search-t51-v3-s453051/a1``.

    Same shape as `mass_ops.layout.EpisodeUnit.key` without its ``<cycle>/`` prefix (the cycle is a column here);
    ``-g<generation>`` is added when the executing generation is part of the identity (rollouts of two generations
    share seeds for paired comparison). A text key instead of a composite unique constraint because `version`,
    `candidate` and `generation` are often absent and SQL treats NULLs as distinct, which would let duplicates in.
    Never change this format: stored keys must keep matching on resume.
    """
    slug = episode_unit_slug(
        task_id=task_id, kind=kind, seed=seed, version=version, candidate=candidate, generation=generation
    )
    return f"{slug}/a{attempt}"


def episode_unit_slug(
    *,
    task_id: str,
    kind: str,
    seed: int,
    version: int | None = None,
    candidate: int | None = None,
    generation: str | None = None,
) -> str:
    """The identity of an episode unit across its attempts: `episode_unit_key` without its ``/a<attempt>``."""
    unit = EpisodeUnit(
        cycle="",
        task_id=task_id,  # type: ignore[arg-type]  # the slug only formats it: the stored id is text
        kind=kind,  # type: ignore[arg-type]  # the callers check it against EpisodeKind
        seed=seed,
        version=version,
        candidate=candidate,
        generation=generation,
    )
    return unit.slug


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012 - SQLAlchemy reads this class attribute
        datetime: UTCDateTime(),
        dict[str, Any]: JSONDocument,
    }

    def __repr__(self) -> str:
        key = getattr(self, "id", None)
        return f"{type(self).__name__}(id={key})"


def _created() -> Mapped[datetime]:
    return mapped_column(default=utcnow)


class Cycle(Base):
    """One MASS cycle L(k) → L(k+1); its frozen config and hash."""

    __tablename__ = "cycles"
    __table_args__ = (sa.UniqueConstraint("name"), one_of("status", RunStatus))

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(128))
    generation: Mapped[int] = mapped_column()
    preset: Mapped[str | None] = mapped_column(sa.String(64))
    parent_model: Mapped[str | None] = mapped_column(sa.String(256))
    config: Mapped[dict[str, Any]] = mapped_column()
    config_hash: Mapped[str] = mapped_column(sa.String(64))
    status: Mapped[str] = mapped_column(sa.String(16), default=RunStatus.PENDING.value)
    # What the cycle ran with beyond its config, by kind: {"catalogue": {...}, "prompts": {name: sha256}, ...}.
    provenance: Mapped[dict[str, Any] | None] = mapped_column()
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column()


class CycleTask(Base):
    """A task taking part in a cycle, its split and the hashes of the prompts it was started with."""

    __tablename__ = "cycle_tasks"
    __table_args__ = (sa.UniqueConstraint("cycle_id", "task_id"), one_of("split", TaskSplit))

    id: Mapped[int] = mapped_column(primary_key=True)
    cycle_id: Mapped[int] = mapped_column(sa.ForeignKey("cycles.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(sa.String(64))
    split: Mapped[str] = mapped_column(sa.String(8))
    excluded: Mapped[bool] = mapped_column(default=False)
    exclusion_reason: Mapped[str | None] = mapped_column(sa.Text)
    bare_prompt_sha256: Mapped[str | None] = mapped_column(sa.String(64))
    initial_prompt_sha256: Mapped[str | None] = mapped_column(sa.String(64))
    created_at: Mapped[datetime] = _created()


class LLMCall(Base):
    """One judge / optimizer / arbitration call; prompt and answer live in the artifact store."""

    __tablename__ = "llm_calls"
    __table_args__ = (
        sa.UniqueConstraint("cycle_id", "unit_key"),
        sa.Index(None, "cycle_id", "purpose"),
        one_of("purpose", CallPurpose),
        one_of("status", CallStatus),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    cycle_id: Mapped[int] = mapped_column(sa.ForeignKey("cycles.id", ondelete="CASCADE"))
    unit_key: Mapped[str] = mapped_column(sa.String(200))
    task_id: Mapped[str | None] = mapped_column(sa.String(64))
    purpose: Mapped[str] = mapped_column(sa.String(16))
    model: Mapped[str] = mapped_column(sa.String(256))
    provider: Mapped[str | None] = mapped_column(sa.String(64))
    seed: Mapped[int | None] = mapped_column(sa.BigInteger)
    status: Mapped[str] = mapped_column(sa.String(16))
    prompt_tokens: Mapped[int | None] = mapped_column(sa.BigInteger)
    completion_tokens: Mapped[int | None] = mapped_column(sa.BigInteger)
    usage: Mapped[dict[str, Any] | None] = mapped_column()
    cost_usd: Mapped[float | None] = mapped_column(sa.Float)
    latency_s: Mapped[float | None] = mapped_column(sa.Float)
    prompt_uri: Mapped[str | None] = mapped_column(sa.String(1024))
    result_uri: Mapped[str | None] = mapped_column(sa.String(1024))
    error: Mapped[str | None] = mapped_column(sa.Text)
    prompt_sha256: Mapped[str | None] = mapped_column(sa.String(64))
    result_sha256: Mapped[str | None] = mapped_column(sa.String(64))
    created_at: Mapped[datetime] = _created()
    # usage.prompt_tokens_details.cached_tokens where the server reports it (prompt-cache hits), else NULL
    cached_prompt_tokens: Mapped[int | None] = mapped_column(sa.BigInteger)


class WorkflowVersion(Base):
    """Version k of a task's multi-agent design: the design text, its parent and the diff from it."""

    __tablename__ = "workflow_versions"
    __table_args__ = (sa.UniqueConstraint("cycle_id", "task_id", "version"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    cycle_id: Mapped[int] = mapped_column(sa.ForeignKey("cycles.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(sa.String(64))
    version: Mapped[int] = mapped_column()
    parent_version: Mapped[int | None] = mapped_column()
    design: Mapped[str] = mapped_column(sa.Text)
    diff: Mapped[str | None] = mapped_column(sa.Text)
    prompt_uri: Mapped[str | None] = mapped_column(sa.String(1024))
    prompt_sha256: Mapped[str | None] = mapped_column(sa.String(64))
    proposal_call_id: Mapped[int | None] = mapped_column(sa.ForeignKey("llm_calls.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = _created()


class Episode(Base):
    """One agent run (reference, search version, collection candidate, rollout or benchmark trial)."""

    __tablename__ = "episodes"
    __table_args__ = (
        sa.UniqueConstraint("cycle_id", "unit_key"),
        sa.Index(None, "cycle_id", "task_id", "kind", "status"),
        one_of("kind", EpisodeKind),
        one_of("status", EpisodeStatus),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    cycle_id: Mapped[int] = mapped_column(sa.ForeignKey("cycles.id", ondelete="CASCADE"))
    unit_key: Mapped[str] = mapped_column(sa.String(200))
    task_id: Mapped[str] = mapped_column(sa.String(64))
    kind: Mapped[str] = mapped_column(sa.String(16))
    version: Mapped[int | None] = mapped_column()
    candidate: Mapped[int | None] = mapped_column()
    generation: Mapped[str | None] = mapped_column(sa.String(64))
    seed: Mapped[int] = mapped_column(sa.BigInteger)
    attempt: Mapped[int] = mapped_column(default=1)
    condition: Mapped[str | None] = mapped_column(sa.String(128))
    model: Mapped[str | None] = mapped_column(sa.String(256))
    status: Mapped[str] = mapped_column(sa.String(16))
    exit_code: Mapped[int | None] = mapped_column()
    failure: Mapped[dict[str, Any] | None] = mapped_column()
    prompt_sha256: Mapped[str | None] = mapped_column(sa.String(64))
    prompt_tokens: Mapped[int | None] = mapped_column(sa.BigInteger)
    completion_tokens: Mapped[int | None] = mapped_column(sa.BigInteger)
    requests: Mapped[int | None] = mapped_column()
    max_prompt_tokens: Mapped[int | None] = mapped_column(sa.BigInteger)
    started_at: Mapped[datetime | None] = mapped_column()
    finished_at: Mapped[datetime | None] = mapped_column()
    duration_s: Mapped[float | None] = mapped_column(sa.Float)
    artifacts: Mapped[dict[str, Any] | None] = mapped_column()
    qwen_code_version: Mapped[str | None] = mapped_column(sa.String(32))
    retry_of_id: Mapped[int | None] = mapped_column(sa.ForeignKey("episodes.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = _created()
    # name -> SHA-256 of each entry of `artifacts`
    artifact_sha256: Mapped[dict[str, Any] | None] = mapped_column()
    # sum of usage.prompt_tokens_details.cached_tokens over the episode's requests (prompt-cache hits)
    cached_prompt_tokens: Mapped[int | None] = mapped_column(sa.BigInteger)


class Comparison(Base):
    """One pairwise judgement in a ledger (RHI baseline, champion arbitration, ranking match, external judge)."""

    __tablename__ = "comparisons"
    __table_args__ = (
        sa.UniqueConstraint("cycle_id", "task_id", "ledger", "key"),
        one_of("ledger", Ledger),
        one_of("verdict", Verdict),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    cycle_id: Mapped[int] = mapped_column(sa.ForeignKey("cycles.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(sa.String(64))
    ledger: Mapped[str] = mapped_column(sa.String(16))
    key: Mapped[str] = mapped_column(sa.String(200))
    side_a: Mapped[str] = mapped_column(sa.String(128))
    side_b: Mapped[str] = mapped_column(sa.String(128))
    episode_a_id: Mapped[int | None] = mapped_column(sa.ForeignKey("episodes.id", ondelete="SET NULL"))
    episode_b_id: Mapped[int | None] = mapped_column(sa.ForeignKey("episodes.id", ondelete="SET NULL"))
    judge_model: Mapped[str] = mapped_column(sa.String(256))
    judge_provider: Mapped[str | None] = mapped_column(sa.String(64))
    seed: Mapped[int | None] = mapped_column(sa.BigInteger)
    swapped: Mapped[bool] = mapped_column(default=False)
    verdict: Mapped[str] = mapped_column(sa.String(8))
    rationale: Mapped[str | None] = mapped_column(sa.Text)
    rationale_uri: Mapped[str | None] = mapped_column(sa.String(1024))
    llm_call_id: Mapped[int | None] = mapped_column(sa.ForeignKey("llm_calls.id", ondelete="SET NULL"))
    usage: Mapped[dict[str, Any] | None] = mapped_column()
    created_at: Mapped[datetime] = _created()
    rationale_sha256: Mapped[str | None] = mapped_column(sa.String(64))


class RetainedWorkflow(Base):
    """Outcome of a task's RHI search: the retained champion version, or none when nothing beat the reference."""

    __tablename__ = "retained_workflows"
    __table_args__ = (sa.UniqueConstraint("cycle_id", "task_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    cycle_id: Mapped[int] = mapped_column(sa.ForeignKey("cycles.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(sa.String(64))
    version: Mapped[int | None] = mapped_column()
    beats_reference: Mapped[bool] = mapped_column()
    model: Mapped[str | None] = mapped_column(sa.String(256))
    last_evaluated_version: Mapped[int] = mapped_column()
    created_at: Mapped[datetime] = _created()


class Ranking(Base):
    """Bradley–Terry score and rank of one collected episode within its task."""

    __tablename__ = "rankings"
    __table_args__ = (sa.UniqueConstraint("episode_id"), sa.Index(None, "cycle_id", "task_id"))

    id: Mapped[int] = mapped_column(primary_key=True)
    cycle_id: Mapped[int] = mapped_column(sa.ForeignKey("cycles.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(sa.String(64))
    episode_id: Mapped[int] = mapped_column(sa.ForeignKey("episodes.id", ondelete="CASCADE"))
    score: Mapped[float] = mapped_column(sa.Float)
    rank: Mapped[int] = mapped_column()
    ci_low: Mapped[float | None] = mapped_column(sa.Float)
    ci_high: Mapped[float | None] = mapped_column(sa.Float)
    created_at: Mapped[datetime] = _created()


class Selection(Base):
    """An episode chosen as a training or validation trajectory."""

    __tablename__ = "selections"
    __table_args__ = (
        sa.UniqueConstraint("episode_id"),
        sa.Index(None, "cycle_id", "split"),
        one_of("split", DataSplit),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    cycle_id: Mapped[int] = mapped_column(sa.ForeignKey("cycles.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(sa.String(64))
    episode_id: Mapped[int] = mapped_column(sa.ForeignKey("episodes.id", ondelete="CASCADE"))
    split: Mapped[str] = mapped_column(sa.String(8))
    rank: Mapped[int | None] = mapped_column()
    weight: Mapped[float] = mapped_column(sa.Float, default=1.0)
    created_at: Mapped[datetime] = _created()


class Dataset(Base):
    """A rendered split (windows JSONL in the artifact store) and its render statistics."""

    __tablename__ = "datasets"
    __table_args__ = (sa.UniqueConstraint("cycle_id", "split"), one_of("split", DataSplit))

    id: Mapped[int] = mapped_column(primary_key=True)
    cycle_id: Mapped[int] = mapped_column(sa.ForeignKey("cycles.id", ondelete="CASCADE"))
    split: Mapped[str] = mapped_column(sa.String(8))
    uri: Mapped[str] = mapped_column(sa.String(1024))
    tokenizer: Mapped[str | None] = mapped_column(sa.String(256))
    episodes: Mapped[int] = mapped_column()
    windows: Mapped[int] = mapped_column()
    loss_tokens: Mapped[int] = mapped_column(sa.BigInteger)
    total_tokens: Mapped[int] = mapped_column(sa.BigInteger)
    stats: Mapped[dict[str, Any] | None] = mapped_column()
    created_at: Mapped[datetime] = _created()


class TrainingWindow(Base):
    """Index entry of one training window (the token ids stay in the dataset artifact, at `position`)."""

    __tablename__ = "training_windows"
    __table_args__ = (
        sa.UniqueConstraint("dataset_id", "position"),
        sa.Index(None, "dataset_id", "task_id", "role"),
        one_of("role", WindowRole),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    dataset_id: Mapped[int] = mapped_column(sa.ForeignKey("datasets.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column()
    episode_id: Mapped[int | None] = mapped_column(sa.ForeignKey("episodes.id", ondelete="SET NULL"))
    task_id: Mapped[str] = mapped_column(sa.String(64))
    role: Mapped[str] = mapped_column(sa.String(16))
    is_main: Mapped[bool] = mapped_column()
    thread: Mapped[str | None] = mapped_column(sa.String(64))
    segment: Mapped[int | None] = mapped_column()
    window_index: Mapped[int] = mapped_column()
    n_windows: Mapped[int] = mapped_column()
    n_tokens: Mapped[int] = mapped_column()
    n_loss_tokens: Mapped[int] = mapped_column()
    weight: Mapped[float] = mapped_column(sa.Float, default=1.0)


class TrainingRun(Base):
    """One SFT job of a cycle; `key` names it within the cycle (e.g. "sft")."""

    __tablename__ = "training_runs"
    __table_args__ = (sa.UniqueConstraint("cycle_id", "key"), one_of("status", RunStatus))

    id: Mapped[int] = mapped_column(primary_key=True)
    cycle_id: Mapped[int] = mapped_column(sa.ForeignKey("cycles.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(sa.String(64))
    args: Mapped[dict[str, Any]] = mapped_column()
    status: Mapped[str] = mapped_column(sa.String(16), default=RunStatus.PENDING.value)
    log_uri: Mapped[str | None] = mapped_column(sa.String(1024))
    output_uri: Mapped[str | None] = mapped_column(sa.String(1024))
    started_at: Mapped[datetime | None] = mapped_column()
    finished_at: Mapped[datetime | None] = mapped_column()
    created_at: Mapped[datetime] = _created()
    log_sha256: Mapped[str | None] = mapped_column(sa.String(64))


class Checkpoint(Base):
    """A training step with a saved adapter (`uri`) and/or a validation loss.

    The step-0 validation has no adapter, hence `uri` is optional.
    """

    __tablename__ = "checkpoints"
    __table_args__ = (sa.UniqueConstraint("run_id", "step"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("training_runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column()
    uri: Mapped[str | None] = mapped_column(sa.String(1024))
    train_loss: Mapped[float | None] = mapped_column(sa.Float)
    val_loss: Mapped[float | None] = mapped_column(sa.Float)
    val_tokens: Mapped[int | None] = mapped_column(sa.BigInteger)
    created_at: Mapped[datetime] = _created()
    sha256: Mapped[str | None] = mapped_column(sa.String(64))


class ModelGeneration(Base):
    """A registered model L(k): its weights and where it came from."""

    __tablename__ = "model_generations"
    __table_args__ = (sa.UniqueConstraint("name"), sa.Index(None, "generation"))

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(128))
    generation: Mapped[int] = mapped_column()
    parent_id: Mapped[int | None] = mapped_column(sa.ForeignKey("model_generations.id", ondelete="RESTRICT"))
    cycle_id: Mapped[int | None] = mapped_column(sa.ForeignKey("cycles.id", ondelete="RESTRICT"))
    checkpoint_id: Mapped[int | None] = mapped_column(sa.ForeignKey("checkpoints.id", ondelete="RESTRICT"))
    bf16_uri: Mapped[str] = mapped_column(sa.String(1024))
    fp8_uri: Mapped[str | None] = mapped_column(sa.String(1024))
    served_name: Mapped[str | None] = mapped_column(sa.String(256))
    lineage: Mapped[dict[str, Any] | None] = mapped_column()
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    # SHA-256 of each model's manifest.json (which lists every file's hash)
    bf16_sha256: Mapped[str | None] = mapped_column(sa.String(64))
    fp8_sha256: Mapped[str | None] = mapped_column(sa.String(64))


class Evaluation(Base):
    """A finished evaluation (external pairwise report, benchmark run, nightly check) of a generation."""

    __tablename__ = "evaluations"
    __table_args__ = (sa.UniqueConstraint("key"), sa.Index(None, "generation_id"))

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(sa.String(200))
    kind: Mapped[str] = mapped_column(sa.String(64))
    cycle_id: Mapped[int | None] = mapped_column(sa.ForeignKey("cycles.id", ondelete="SET NULL"))
    generation_id: Mapped[int] = mapped_column(sa.ForeignKey("model_generations.id", ondelete="CASCADE"))
    baseline_generation_id: Mapped[int | None] = mapped_column(
        sa.ForeignKey("model_generations.id", ondelete="CASCADE")
    )
    results: Mapped[dict[str, Any]] = mapped_column()
    results_uri: Mapped[str | None] = mapped_column(sa.String(1024))
    created_at: Mapped[datetime] = _created()
    results_sha256: Mapped[str | None] = mapped_column(sa.String(64))


class BudgetSpend(Base):
    """Spend so far of one budget scope of a cycle (``cycle``, ``task:<id>``, ``in_loop``): tokens, server-reported
    cost and requests, incremented atomically by every process and pod of the cycle (revision 0004)."""

    __tablename__ = "budget_spend"
    __table_args__ = (sa.UniqueConstraint("cycle_id", "scope"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    cycle_id: Mapped[int] = mapped_column(sa.ForeignKey("cycles.id", ondelete="CASCADE"))
    scope: Mapped[str] = mapped_column(sa.String(80))
    tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    cost_usd: Mapped[float] = mapped_column(sa.Float, default=0.0)
    requests: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    updated_at: Mapped[datetime] = _created()
    # need (tokens) of the latest request this scope refused: the scope stays exhausted while spent + this exceeds
    # its limit, in every process, and no longer once the limit is raised
    refused_need: Mapped[int | None] = mapped_column(sa.BigInteger)


class BudgetCharge(Base):
    """Marks one charge as made (revision 0005): a spend that must reach the ledger exactly once — a Kubernetes pod's
    episode attempt, charged when its row is ingested — is added with its key in the same transaction as the marker,
    so a retried ingest (or one retried after a crash between the row and the charge) adds nothing twice."""

    __tablename__ = "budget_charges"
    __table_args__ = (sa.UniqueConstraint("cycle_id", "charge_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    cycle_id: Mapped[int] = mapped_column(sa.ForeignKey("cycles.id", ondelete="CASCADE"))
    charge_key: Mapped[str] = mapped_column(sa.String(200))
    created_at: Mapped[datetime] = _created()


LEASE_RENEW_S = 60.0  # how often a local runner renews its attempt's lease
LEASE_LAPSE_S = 5 * LEASE_RENEW_S  # a renewed lease older than this names a runner that died


class EpisodeLease(Base):
    """An episode attempt that has started and is not recorded yet (revision 0005): an episode's row is written only
    when its attempt ends, so this is what tells `status` that the unit is in flight.

    Written by whoever starts the attempt — the local runner as its agent starts, the operator that creates a
    Kubernetes episode pod — and deleted once the attempt's row is recorded (or the attempt died without one). One
    lease per unit: `unit_key` is the episode's unit key without its attempt (`episode_unit_slug`), so a later attempt
    replaces an earlier one's. A crash leaves its lease behind; readers ignore a lease older than the attempt could
    run (`mass_ops.ops.leases`). The identity columns mirror `episodes`, so a reader matches a lease to a unit as it
    matches the unit's rows. `host` says where it runs (host and pid, or the pod's name): never a secret."""

    __tablename__ = "episode_leases"
    __table_args__ = (sa.UniqueConstraint("cycle_id", "unit_key"), one_of("kind", EpisodeKind))

    id: Mapped[int] = mapped_column(primary_key=True)
    cycle_id: Mapped[int] = mapped_column(sa.ForeignKey("cycles.id", ondelete="CASCADE"))
    unit_key: Mapped[str] = mapped_column(sa.String(200))
    task_id: Mapped[str] = mapped_column(sa.String(64))
    kind: Mapped[str] = mapped_column(sa.String(16))
    version: Mapped[int | None] = mapped_column()
    candidate: Mapped[int | None] = mapped_column()
    generation: Mapped[str | None] = mapped_column(sa.String(64))
    attempt: Mapped[int] = mapped_column()
    started_at: Mapped[datetime] = mapped_column()
    host: Mapped[str | None] = mapped_column(sa.String(253))
    # Renewed every LEASE_RENEW_S by a local runner while its attempt lives (None: a pod's lease, which nothing in the
    # pod can renew): a lease not renewed for LEASE_LAPSE_S names a runner that died, whatever the attempt's limit.
    renewed_at: Mapped[datetime | None] = mapped_column()
