"""Teacher collection under the retained workflows and their within-task self-ranking (MASS_SPEC §1, §6)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictBool, StrictInt, model_validator

from mass_ops.config.section import MAX_BOOTSTRAP_SAMPLES, MAX_CANDIDATES, MAX_OPPONENTS, NonNegativeInt, Section


class CollectionConfig(Section):
    """Teacher collection under the retained workflow (MASS_SPEC §1 collect/select)."""

    candidates: Annotated[StrictInt, Field(gt=0, le=MAX_CANDIDATES)] = Field(
        default=18,
        description=(
            "Teacher episodes collected per training task under its retained workflow. Reference: 18; at most 256."
        ),
    )
    train_ranks: Annotated[StrictInt, Field(gt=0, le=MAX_CANDIDATES)] = Field(
        default=15,
        description=(
            "Best-ranked candidates per task that become training trajectories (ranks 1..train_ranks). Reference: 15."
        ),
    )
    validation_rank: Annotated[StrictInt, Field(gt=0, le=MAX_CANDIDATES)] = Field(
        default=16,
        description=(
            "Rank whose candidate becomes the task's validation trajectory; must be train_ranks + 1. Reference: 16."
        ),
    )
    seed_base: NonNegativeInt = Field(
        default=710000,
        description=(
            "Base of the collection seeds: candidate i of task q uses seed_base + 100·q + i. Reference: 710000 "
            "(cycle 2: 1710000)."
        ),
    )
    require_beats_reference: StrictBool = Field(
        default=True, description="Skip tasks whose retained workflow never beat the reference (paper behaviour)."
    )

    @model_validator(mode="after")
    def _ranks(self) -> CollectionConfig:
        problems = []
        if self.validation_rank != self.train_ranks + 1:
            problems.append(
                f"validation_rank: {self.validation_rank} must equal train_ranks + 1 ({self.train_ranks + 1})"
            )
        if self.candidates < self.validation_rank:
            problems.append(f"candidates: {self.candidates} must be ≥ validation_rank ({self.validation_rank})")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class RankingConfig(Section):
    """Within-task self-ranking: ring tournament + Bradley–Terry (MASS_SPEC §6)."""

    opponents_per_episode: Annotated[StrictInt, Field(gt=0, le=MAX_OPPONENTS)] = Field(
        default=6,
        description=(
            "Opponents each candidate meets in the ring tournament (even; each pair judged once). Reference: 6; "
            "at most 32."
        ),
    )
    seed: NonNegativeInt = Field(
        default=1234,
        description=(
            "Base seed of the tournament schedule (seed + q) and of each self-judge match (seed + 1000·q + i). "
            "Reference: 1234."
        ),
    )
    bootstrap_samples: Annotated[StrictInt, Field(ge=0, le=MAX_BOOTSTRAP_SAMPLES)] = Field(
        default=1000,
        description=(
            "Bootstrap resamples of each task's tournament for confidence intervals on the Bradley–Terry scores "
            "(recorded, never used for selection); below 2 skips them. Default 1000; at most 100000."
        ),
    )

    @model_validator(mode="after")
    def _even(self) -> RankingConfig:
        if self.opponents_per_episode < 2 or self.opponents_per_episode % 2:
            raise ValueError(f"opponents_per_episode: {self.opponents_per_episode} must be even and ≥ 2")
        return self
