"""`CycleConfig`: one MASS cycle L(k) → L(k+1), every section together, the cross-section rules and the hash."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import Field, model_validator

from mass_ops.config.budgets import BudgetsConfig, PricesConfig
from mass_ops.config.collection import CollectionConfig, RankingConfig
from mass_ops.config.deployment import ComputeConfig, RuntimeConfig, StorageConfig
from mass_ops.config.evaluation import EvaluationConfig, ExportConfig, PromotionConfig
from mass_ops.config.inference import InferenceConfig, ModelsConfig, PromptsConfig
from mass_ops.config.search import JudgeConfig, SearchConfig
from mass_ops.config.section import CYCLE_NAME, MAX_TRAINING_STEPS, ConfigError, NonNegativeInt, Section
from mass_ops.config.tasks import CATALOGUE_NOT_CHOSEN, TasksConfig
from mass_ops.config.training import TrainingConfig

# Presets that must reproduce the reference release's batch geometry (3 windows per optimizer step).
PAPER_PRESETS = frozenset({"paper", "cycle2"})


class CycleConfig(Section):
    """One MASS cycle L(generation) → L(generation + 1)."""

    name: str | None = Field(default=None, description="Cycle name; default '<preset>-L<generation>'.")
    preset: Literal["paper", "cycle2", "demo", "custom"] = Field(
        default="custom",
        description=(
            "Which shipped preset this config derives from ('paper', 'cycle2', 'demo') or 'custom'; the paper "
            "presets get the reference's batch rule."
        ),
    )
    generation: NonNegativeInt = Field(
        description=(
            "Generation k of the model that this cycle improves: the cycle turns L(k) into L(k + 1). Reference: "
            "0 (cycle 2: 1)."
        ),
    )
    models: ModelsConfig = Field(
        description="Where the models of this cycle live.",
    )
    inference: InferenceConfig = Field(
        default_factory=InferenceConfig,
        description="The endpoint and token budgets of every model call.",
    )
    tasks: TasksConfig = Field(
        description="Which tasks are searched, trained on and held out.",
    )
    search: SearchConfig = Field(
        default_factory=SearchConfig,
        description="RHI workflow search.",
    )
    judge: JudgeConfig = Field(
        default_factory=JudgeConfig,
        description="Retries and tolerance of judge answers that are not usable verdicts.",
    )
    collection: CollectionConfig = Field(
        default_factory=CollectionConfig,
        description="Teacher collection under the retained workflows.",
    )
    ranking: RankingConfig = Field(
        default_factory=RankingConfig,
        description="Within-task self-ranking of the teacher candidates.",
    )
    training: TrainingConfig = Field(
        default_factory=TrainingConfig,
        description="LoRA fine-tuning.",
    )
    export: ExportConfig = Field(
        default_factory=ExportConfig,
        description="Merge and export of the trained model.",
    )
    evaluation: EvaluationConfig = Field(
        default_factory=EvaluationConfig,
        description="Rollouts, external judging and the nightly regression check.",
    )
    prompts: PromptsConfig = Field(
        default_factory=PromptsConfig,
        description="The prompt templates every model call is built from (shipped, or replaced from a folder).",
    )
    storage: StorageConfig = Field(
        default_factory=StorageConfig,
        description="Where records and artifacts live (not part of the config hash).",
    )
    compute: ComputeConfig = Field(
        default_factory=ComputeConfig,
        description="Where commands run.",
    )
    runtime: RuntimeConfig = Field(
        default_factory=RuntimeConfig,
        description="Limits of one episode.",
    )
    budgets: BudgetsConfig = Field(
        default_factory=BudgetsConfig,
        description="Token and cost budgets per episode, task, cycle and for in-loop calls (not part of the hash).",
    )
    prices: PricesConfig = Field(
        default_factory=PricesConfig,
        description="Token and GPU-hour prices of the cost estimate and spend reports (not part of the config hash).",
    )
    promotion: PromotionConfig = Field(
        default_factory=PromotionConfig,
        description="Whether a person approves the new generation before it is served (not part of the hash).",
    )

    @model_validator(mode="after")
    def _cross(self) -> CycleConfig:
        problems = []
        if self.preset in PAPER_PRESETS and self.training.windows_per_step != 3:
            problems.append("training.windows_per_step: the paper presets average exactly 3 windows per step")
        if self.name is not None and not CYCLE_NAME.fullmatch(self.name):
            problems.append("name: must be 1-63 letters, digits, '.', '_' or '-'")
        # TrainingConfig's own fields carry only the generic integer bound; `plan` counts checkpoints and
        # validations step by step, so the step count is bounded here.
        if self.training.steps > MAX_TRAINING_STEPS:
            problems.append(f"training.steps: {self.training.steps} exceeds the maximum of {MAX_TRAINING_STEPS}")
        pool = self.evaluation.tasks or []
        known = set(self.tasks.train_candidates) | set(self.tasks.test)
        stray = sorted(set(pool) - known)
        if stray:
            problems.append(f"evaluation.tasks: {stray} are neither train candidates nor test tasks")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def cycle_name(self) -> str:
        """The cycle's name in the metadata store."""
        return self.name or f"{self.preset}-L{self.generation}"

    def require_catalogue(self) -> str:
        """The chosen task catalogue ('builtin' or a directory); `ConfigError` (one line saying how to choose) when
        `tasks.catalogue` is unset, as the paper and cycle2 presets leave it. `validate` and every stage call this
        before loading tasks; `plan` does not, so it works offline on every preset."""
        if self.tasks.catalogue is None:
            raise ConfigError([CATALOGUE_NOT_CHOSEN])
        return self.tasks.catalogue

    @property
    def catalogue_label(self) -> str:
        """`tasks.catalogue` for display: its value, or 'not chosen' (what `plan` shows for the paper presets)."""
        return self.tasks.catalogue or "not chosen"

    @property
    def is_remote_backend(self) -> bool:
        """OpenRouter serves a model we cannot train or export (MASS_SPEC §1)."""
        return self.inference.backend == "openrouter"

    def rollout_tasks(self) -> list[int]:
        """The evaluation pool: configured, else the SFT tasks plus the test tasks."""
        return list(self.evaluation.tasks) if self.evaluation.tasks else list(self.tasks.train) + list(self.tasks.test)

    def config_hash(self) -> str:
        """SHA-256 of the canonical config without `storage` (where records live is not what the cycle is) and
        `budgets` (raising a budget and rerunning continues the same cycle), `prices` (what things cost) or
        `promotion` (who approves the result)."""
        payload = self.model_dump(mode="json", exclude={"storage", "budgets", "prices", "promotion"})
        return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
