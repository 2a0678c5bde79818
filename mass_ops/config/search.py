"""RHI workflow search (MASS_SPEC §3) and what every judging stage does with an unusable verdict (§5)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictInt

from mass_ops.config.section import (
    MAX_JUDGE_INVALID_RETRIES,
    MAX_SEARCH_ITERATIONS,
    NonNegativeInt,
    PositiveInt,
    Probability,
    Section,
)


class SearchConfig(Section):
    """RHI workflow search (MASS_SPEC §3)."""

    iterations: Annotated[StrictInt, Field(gt=0, le=MAX_SEARCH_ITERATIONS)] = Field(
        default=11,
        description=(
            "RHI improvement steps per task; the search produces iterations + 1 workflow versions (v0..vN). "
            "Reference: 11; at most 100."
        ),
    )
    seed_base: NonNegativeInt = Field(
        default=450000,
        description=(
            "Base of the search seeds: the reference episode of task q uses seed_base + q, version k uses "
            "seed_base + q + 1000·k. Reference: 450000 (cycle 2: 1450000)."
        ),
    )
    swap_consistent: StrictBool = Field(default=False, description="Judge both orders; disagreement = tie (not paper).")
    on_invalid_proposal: Literal["fail", "keep_design"] = Field(
        default="fail",
        description="When the optimizer's answer is unusable: fail the step (paper; a rerun retries it) or carry the "
        "current design forward as the next version, recorded as such (demo: a random model never writes JSON).",
    )
    reject_numeric_caps: StrictBool = Field(
        default=False,
        description=(
            "Refuse optimizer designs that impose fixed numeric caps on agents (a reference flag the pipeline "
            "does not use)."
        ),
    )
    max_design_chars: PositiveInt | None = Field(
        default=None,
        description=(
            "Longest workflow design, in characters, an optimizer answer may propose; none = no limit (the "
            "reference pipeline sets none)."
        ),
    )
    results_json_max_chars: PositiveInt = Field(
        default=24000,
        description=(
            "Characters of each results/*.json file shown to the optimizer and judge (longer files keep their "
            "head and tail). Reference: 24000."
        ),
    )
    results_json_total_max_chars: PositiveInt = Field(
        default=120000,
        description=(
            "Characters of all results/*.json files together shown to the optimizer and judge. Reference: 120000."
        ),
    )


class JudgeConfig(Section):
    """What happens when a judge answers with something that is not a usable verdict (MASS_SPEC §5), in every stage
    that judges: search (judging and arbitration), rank (self-judge) and evaluate (external judges, self-judge)."""

    invalid_retries: Annotated[StrictInt, Field(ge=0, le=MAX_JUDGE_INVALID_RETRIES)] = Field(
        default=2,
        description=(
            "Extra calls a judge gets, per run of a stage, when its answer is not a usable verdict (not JSON, wrong "
            "schema, empty); each retry samples with a seed derived from the call's seed and the number of unusable "
            "answers so far (seeds.judge_retry_seed). The reference makes no retry; at most 16."
        ),
    )
    max_invalid_fraction: Probability = Field(
        default=0.0,
        description=(
            "Largest share of a stage's verdicts (per task in search and rank, per judge in evaluate) that may stay "
            "invalid after the retries and count as ties. Above it the stage fails; finished verdicts stay recorded "
            "and a rerun judges only the missing ones. Reference: 0 (it aborts on invalid output); demo: 1."
        ),
    )
    position_bias_sample: Probability = Field(
        default=0.0,
        description=(
            "Share of judged pairs (every judging stage and external judge) judged once more with A and B swapped, "
            "to measure position bias: the report's flip rate per judge. The pick is a hash of the call's key, so "
            "it is the same on every rerun. The extra call is recorded (key '<call>/swapped') but never changes the "
            "verdict used for RHI or ranking. Reference: 0 (one call per pair); demo: 0.5."
        ),
    )
    verdict_parsing: Literal["strict", "lenient"] = Field(
        default="strict",
        description=(
            "How every judging stage (search, rank, evaluate, the position-bias check) reads a judge's answer. "
            "'strict': the reference's schema exactly - winner exactly 'A', 'B' or 'tie', a rationale of at least "
            "one character kept as written - and the reference's JSON reading on the call's route (chat: the whole "
            "text, else its outermost {...}, else the first fenced block; Responses API: the whole text only; "
            "Anthropic: the first fenced block, else the outermost {...}). "
            "'lenient': winner case- and space-insensitive, rationale trimmed and non-blank, any fenced block "
            "tried. Unusable answers are retried (invalid_retries) in both. Reference: strict; demo: lenient."
        ),
    )
