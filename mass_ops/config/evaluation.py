"""After training: the export formats, evaluation (rollouts, external judges, the nightly check) and promotion.

External judges report only; they never take part in selection.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictInt, model_validator

from mass_ops.config.inference import is_http_url
from mass_ops.config.section import (
    IDENTIFIER,
    MAX_JUDGE_SEEDS,
    MAX_JUDGES,
    MAX_ROLLOUTS,
    NonNegativeInt,
    PositiveInt,
    Probability,
    Section,
    TaskList,
)


class ExportConfig(Section):
    """Merge to BF16 and block-wise FP8 (MASS_SPEC §9)."""

    fp8_block_size: Literal[128] = Field(
        default=128,
        description=(
            "Side of the square weight blocks that share one FP8 scale (128 × 128, as the official FP8 checkpoints)."
        ),
    )
    formats: Annotated[list[Literal["bf16", "fp8"]], Field(max_length=2)] = Field(
        default=["bf16", "fp8"],
        description=(
            "Which exports to write after training: the merged BF16 model, the block-wise FP8 model, or both. "
            "Reference: both."
        ),
    )


class ExternalJudgeConfig(Section):
    """One external judge used for reporting only (never for selection)."""

    name: str = Field(
        min_length=1,
        description="Label of the judge in reports and rows.",
    )
    provider: Literal["openai-compatible", "anthropic"] = Field(
        description=(
            "API the judge speaks: 'openai-compatible' (OpenAI Responses/Chat style) or 'anthropic' (Messages API)."
        ),
    )
    model: str = Field(
        min_length=1,
        description="Model id sent to the provider.",
    )
    base_url: str | None = Field(
        default=None,
        description="http(s) base URL of the provider without credentials; none = the provider's default.",
    )
    api_key_env: str = Field(
        description="NAME of the environment variable holding the judge's API key (never the key itself).",
    )
    reasoning_effort: str | None = Field(
        default=None,
        description="Reasoning effort passed to the provider as is (e.g. 'xhigh', 'max'); none = its default.",
    )
    api: Literal["chat", "responses"] = Field(
        default="chat",
        description=(
            "Endpoint an openai-compatible judge is called on: 'chat' (POST /chat/completions, the effort as "
            "reasoning_effort, the cap as max_completion_tokens) or 'responses' (POST /responses: instructions + "
            "input, text.format json_object, reasoning.effort, the cap as max_output_tokens). Anthropic judges "
            "take 'chat' only (their Messages API). Reference: responses for gpt-5.5."
        ),
    )
    max_tokens: PositiveInt | None = Field(
        default=32768,
        description=(
            "Most tokens the judge may generate per verdict; none = no cap sent (Anthropic requires one: 4096 is "
            "sent then, as in the reference). Reference: none for gpt-5.5 (Responses API), 32768 for Claude."
        ),
    )

    @model_validator(mode="after")
    def _key_env(self) -> ExternalJudgeConfig:
        if not IDENTIFIER.fullmatch(self.api_key_env):
            raise ValueError("api_key_env: must be an environment variable name, not a key")
        if self.provider == "anthropic" and self.api != "chat":
            raise ValueError(f"api: {self.api!r} applies to openai-compatible judges only (anthropic: leave it unset)")
        if self.base_url is not None and not is_http_url(self.base_url):
            raise ValueError(f"base_url: {self.base_url!r} must be an http(s) URL without credentials")
        return self


class EvaluationConfig(Section):
    """Rollouts, external pairwise judging and the nightly regression check (MASS_SPEC §10)."""

    rollout_count: Annotated[StrictInt, Field(gt=0, le=MAX_ROLLOUTS)] = Field(
        default=10,
        description=(
            "Rollouts per task and generation in evaluation (bare prompt, no workflow). Reference: 10; at most 1000."
        ),
    )
    rollout_seed_base: NonNegativeInt = Field(
        default=910000,
        description=(
            "Base of the rollout seeds: rollout i of task q uses rollout_seed_base + 100·q + i. Reference: 910000."
        ),
    )
    tasks: TaskList | None = Field(
        default=None, description="Rollout pool; none = the 8 SFT tasks + the test tasks (the paper's 11-task pool)."
    )
    judge_seeds: Annotated[list[NonNegativeInt], Field(max_length=MAX_JUDGE_SEEDS)] = Field(
        default=[42, 43, 44],
        description=(
            "Presentation seeds of the external pairwise judging; every pair is judged once per seed and judge. "
            "Reference: [42, 43, 44]."
        ),
    )
    judges: Annotated[list[ExternalJudgeConfig], Field(max_length=MAX_JUDGES)] = Field(
        default=[],
        description=(
            "External judges used for reporting only, never for selection. Reference: gpt-5.5 and claude-opus-4-8."
        ),
    )
    swap_consistent: StrictBool = Field(
        default=False,
        description="Judge each pair in both orders and count a disagreement as a tie (not what the reference does).",
    )
    regression_threshold: Probability = Field(
        default=0.05,
        description=(
            "The nightly check fails when the new generation's win rate against its parent is below 0.5 minus "
            "this. Default 0.05."
        ),
    )


class PromotionConfig(Section):
    """When a newly registered generation L(k+1) becomes the served model: what nightly evaluation evaluates and
    what the next cycle starts from. Not part of the config hash (an operational choice, not what the cycle is)."""

    require_approval: StrictBool = Field(
        default=False,
        description=(
            "Wait for a person's approval in Airflow (a human-in-the-loop task showing the evaluation's headline) "
            "before promoting the new generation; rejected or pending, nightly runs keep evaluating the previous "
            "one and no next cycle starts. Reference: false (the reference release has no gate)."
        ),
    )
