"""The report's vocabulary, at the bottom of the package: it imports none of its siblings.

`FIGURES` names every figure in document order. The report's stages are the cost categories of the stage registry
(`mass_ops.stage_registry`), in its order (`STAGE_ORDER`): `episode_stage` and `call_stage` place a record in one,
`JUDGING_STAGES` names the judging of each ledger. The frozen records are what the readers return, `ReportData`
holds them all, and a `Block` is one unit of the document that both renderers draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mass_ops.cost.records import CarriesUsage, StageUsage, total_usage
from mass_ops.evaluation.agreement import Agreement
from mass_ops.evaluation.benchmarks.table import BenchmarkCell
from mass_ops.evaluation.efficiency import Efficiency
from mass_ops.evaluation.position_bias import FlipRate
from mass_ops.evaluation.stats import PairwiseSummary
from mass_ops.stage_registry import COST_CATEGORIES, TRAIN, call_cost_category, cost_category, episode_cost_category
from mass_ops.store.schema import CallPurpose, EpisodeKind, Ledger

FIGURES = (
    ("rhi_scoreboard", "RHI scoreboard per task"),
    ("search_coverage", "Search coverage per task"),
    ("win_rate_by_generation", "Win rate by generation (95% intervals)"),
    ("judge_agreement", "Judge agreement by generation"),
    ("ranking_scores", "Bradley–Terry score per trajectory (95% bootstrap intervals)"),
    ("loss_curves", "Training and validation loss"),
    ("training_throughput", "Training throughput (tokens/s) and MFU"),
    ("tokens_cost", "Tokens and cost per stage"),
    ("wallclock_gpu", "Wall-clock and GPU-hours per stage"),
    ("benchmark_table", "Public benchmarks by generation: score and score per output token vs L0"),
)
STAGE_ORDER = COST_CATEGORIES
TRAIN_STAGE = cost_category(TRAIN)  # the training runs' GPU time and wall-clock
# An external judge's calls run elsewhere: every other purpose is served by our inference server (in-loop).
IN_LOOP_PURPOSES = frozenset(p.value for p in CallPurpose if p is not CallPurpose.EXTERNAL_JUDGE)
_EXTERNAL_STAGE = call_cost_category("", CallPurpose.EXTERNAL_JUDGE.value)


def episode_stage(kind: str) -> str:
    """The report's stage of an episode of `kind`: the registry's cost category, else the kind itself."""
    return episode_cost_category(kind) or kind


def call_stage(unit_key: str, purpose: str) -> str:
    """The report's stage of a model call (the registry's cost category of its key or purpose); a call the registry
    does not place counts with the external judges."""
    return call_cost_category(unit_key, purpose) or _EXTERNAL_STAGE or purpose


# The mappings as tables (part of the package's interface): every episode kind, and the in-loop purposes.
EPISODE_STAGE = {kind.value: episode_stage(kind.value) for kind in EpisodeKind}
CALL_STAGE = {purpose: call_stage("", purpose) for purpose in sorted(IN_LOOP_PURPOSES)}
# Judging stages by ledger, in the order of the cycle; evaluation rows are per judge ("evaluate: <judge>").
JUDGING_STAGES = {
    ledger: f"{call_stage('', purpose)}: {what}"
    for ledger, purpose, what in (
        (Ledger.RHI, CallPurpose.JUDGE, "vs reference"),
        (Ledger.CHAMPION, CallPurpose.ARBITRATION, "arbitration"),
        (Ledger.RANKING, CallPurpose.SELF_JUDGE, "self-judge"),
    )
}


@dataclass(frozen=True)
class TaskScoreboard:
    """One task's RHI record: each version's result against the reference, and the champion."""

    task: int
    split: str
    results: dict[int, str]  # version -> W / L / T
    champion: int | None
    executed: int
    planned: int
    retained_recorded: bool

    @property
    def wins(self) -> int:
        return sum(1 for r in self.results.values() if r == "W")


@dataclass(frozen=True)
class PairwiseEvaluation:
    """A recorded pairwise evaluation (possibly of another cycle, for the trend by generation)."""

    key: str
    label: str
    cycle: str
    generation_a: str
    generation_b: str
    order: tuple[int, int, int]
    pairs: int
    judges: list[str]
    seeds: list[int]
    summary: PairwiseSummary
    agreement: dict[str, Agreement]


@dataclass(frozen=True)
class JudgeValidity:
    """The judging of one stage: verdicts recorded, those recorded invalid (counted as ties), and judge answers
    that were not usable verdicts (each one an attempt, retried with a derived seed or ending in an invalid
    verdict)."""

    stage: str
    verdicts: int
    invalid: int
    unusable_answers: int


@dataclass(frozen=True)
class PromptDigest:
    """One prompt template the cycle recorded: its SHA-256 and whether it is the shipped text."""

    name: str
    sha256: str
    shipped: bool | None  # None: a template this version of mass-ops does not ship


@dataclass(frozen=True)
class LossCurve:
    """The losses of one training run."""

    run: str
    train: list[tuple[int, float]]
    val: list[tuple[int, float]]
    selected_step: int | None
    selected_val_loss: float | None


@dataclass(frozen=True)
class StageCost(CarriesUsage):
    """What one stage used, read from its records. `usage.cost_usd`: what the stage cost at `config.prices` — each
    call's server-reported cost (else its model's per-token price), the agents' tokens at a priced model's per-token
    price, and the stage's GPU-hours at the serving or training price (none on a CPU run); `usage.wall_clock_s`: its
    span (time with at least one of its units running); `busy_s`: its units' summed time."""

    stage: str
    usage: StageUsage = field(default_factory=StageUsage)
    calls: int = 0
    episodes: int = 0
    busy_s: float = 0.0

    @property
    def span_s(self) -> float:
        return self.usage.wall_clock_s


@dataclass(frozen=True)
class RankedTrajectory:
    """One teacher trajectory's Bradley–Terry result in its task's tournament."""

    task: int
    name: str
    rank: int
    score: float
    ci_low: float | None
    ci_high: float | None


@dataclass(frozen=True)
class ThroughputCurve:
    """Per logged step of one training run: tokens/s (all ranks), supervised tokens/s, MFU (None when not
    computed), and peak memory."""

    run: str
    tokens_per_s: list[tuple[int, float]]
    supervised_tokens_per_s: list[tuple[int, float]]
    mfu: list[tuple[int, float]]
    peak_mem_gib: float | None

    @property
    def median_tokens_per_s(self) -> float | None:
        return median([v for _, v in self.tokens_per_s])


@dataclass(frozen=True)
class CacheShare:
    """Prompt-cache hits of one stage: cached prompt tokens over the prompt tokens of the units (LLM calls and
    agent episodes) whose server reported cached tokens; the others are counted, not guessed."""

    stage: str
    units: int
    reporting: int
    cached_tokens: int
    prompt_tokens: int

    @property
    def share(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


def median(values: Sequence[float]) -> float | None:
    """The median of `values`, or None when there is none."""
    ordered = sorted(values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


@dataclass(frozen=True)
class BudgetLine:
    """One budget scope of the ledger: spend so far and its configured limits (None = unlimited)."""

    scope: str
    tokens: int
    cost_usd: float
    requests: int
    token_limit: int | None
    cost_limit: float | None


@dataclass(frozen=True)
class BudgetAlertLine:
    """A budget alert the cycle raised: the scope, the limit's config key and value, the share crossed and when."""

    scope: str
    setting: str  # e.g. budgets.cycle_tokens
    unit: str  # "tokens" or "USD"
    limit: float | None  # the limit now configured; None when the config no longer sets it
    percent: int
    at: str  # when the share was first crossed, as the report prints it (UTC)


@dataclass(frozen=True)
class EstimateRow:
    """One stage: the usage estimated when the cycle was opened (None: the saved estimate has no such stage) against
    the usage its records add up to (its `StageCost.usage`; none recorded: all zero)."""

    stage: str
    estimated: StageUsage | None
    actual: StageUsage

    @property
    def estimated_tokens(self) -> int | None:
        return None if self.estimated is None else self.estimated.tokens

    @property
    def actual_tokens(self) -> int:
        return self.actual.tokens

    @property
    def estimated_gpu_hours(self) -> float | None:
        return None if self.estimated is None else self.estimated.gpu_hours

    @property
    def actual_gpu_hours(self) -> float:
        return self.actual.gpu_hours

    @property
    def estimated_usd(self) -> float | None:
        return None if self.estimated is None else self.estimated.cost_usd

    @property
    def actual_usd(self) -> float:
        return self.actual.cost_usd

    @property
    def token_ratio(self) -> float | None:
        """Estimated over actual tokens (None without an estimate or actual tokens)."""
        if self.estimated_tokens is None or not self.actual_tokens:
            return None
        return self.estimated_tokens / self.actual_tokens


@dataclass(frozen=True)
class TrainingData:
    """The train split the new generation was trained on (its `datasets` row)."""

    trajectories: int
    windows: int
    tokens: int
    supervised_tokens: int


@dataclass(frozen=True)
class DagRun:
    """The Airflow DAG run that wrote the report; `url` is its page (relative to the API server without a base URL)."""

    dag_id: str
    run_id: str
    url: str


# The judge name `stages.evaluate` gives the parent's in-loop judge when it stands in for the external judges.
STAND_IN_JUDGE_PREFIX = "in-loop-"


def is_stand_in(evaluation: PairwiseEvaluation) -> bool:
    """Whether the evaluation was judged by the parent's own in-loop judge, not by external judges."""
    return bool(evaluation.judges) and all(j.startswith(STAND_IN_JUDGE_PREFIX) for j in evaluation.judges)


def judges_label(evaluations: Sequence[PairwiseEvaluation]) -> str:
    """Who judged: "L0's own judge (stand-in)" when the parent's in-loop judge stood in for every evaluation,
    "external judges" when none did, both otherwise."""
    stand_ins = [e for e in evaluations if is_stand_in(e)]
    if not stand_ins:
        return "external judges"
    parents = sorted({e.generation_b for e in stand_ins})
    own = f"{' / '.join(parents)}'s own judge (stand-in)"
    return own if len(stand_ins) == len(evaluations) else f"external judges or {own}"


@dataclass
class ReportData:
    """Everything the report shows, gathered from the stores."""

    cycle: str
    preset: str
    generation: int
    served_model: str
    config_hash: str
    generated_at: str
    catalogue: str = "not recorded"
    catalogue_import: dict[str, Any] | None = None
    prompts: list[PromptDigest] = field(default_factory=list)
    max_invalid_fraction: float = 0.0
    judging: list[JudgeValidity] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    scoreboard: list[TaskScoreboard] = field(default_factory=list)
    evaluations: list[PairwiseEvaluation] = field(default_factory=list)
    rollout_tokens: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    benchmarks: list[tuple[str, str, str, int, str]] = field(default_factory=list)
    efficiency: list[Efficiency] = field(default_factory=list)
    benchmark_table: list[BenchmarkCell] = field(default_factory=list)  # the paper's table (#18.4)
    curves: list[LossCurve] = field(default_factory=list)
    stages: list[StageCost] = field(default_factory=list)
    flip_rates: list[FlipRate] = field(default_factory=list)
    position_bias_sample: float = 0.0
    rankings: list[RankedTrajectory] = field(default_factory=list)
    throughput: list[ThroughputCurve] = field(default_factory=list)
    cache_shares: list[CacheShare] = field(default_factory=list)
    # spend against budget (ledger) and the saved estimate against the actuals (first section; ISSUE #15)
    budgets: list[BudgetLine] = field(default_factory=list)
    budget_alerts: list[BudgetAlertLine] = field(default_factory=list)  # in the order they were raised
    estimate_rows: list[EstimateRow] = field(default_factory=list)
    estimate_source: str | None = None
    # the headline's facts besides the evaluation and the stage totals
    training_data: TrainingData | None = None
    cpu_run: bool = False  # every GPU-hour figure is then 0 and said to be so, never priced
    wall_clock_s: float = 0.0  # first recorded unit start to last recorded unit end
    unbudgeted_tokens: int = 0  # tokens of calls that spend from no budget scope (external judges' own clients)
    failed_stages: list[str] = field(default_factory=list)
    dag_run: DagRun | None = None

    @property
    def own_evaluations(self) -> list[PairwiseEvaluation]:
        return [e for e in self.evaluations if e.cycle == self.cycle]

    @property
    def headline_evaluation(self) -> PairwiseEvaluation | None:
        """This cycle's evaluation of L(k+1) against L(k) (the last recorded), else its last evaluation."""
        own = self.own_evaluations
        new, parent = f"L{self.generation + 1}", f"L{self.generation}"
        matching = [e for e in own if (e.generation_a, e.generation_b) == (new, parent)]
        chosen = matching or own
        return chosen[-1] if chosen else None

    @property
    def total_tokens(self) -> int:
        return total_usage(self.stages).tokens

    @property
    def total_cost_usd(self) -> float:
        return total_usage(self.stages).cost_usd

    @property
    def total_gpu_hours(self) -> float:
        return sum(s.gpu_hours for s in self.stages)  # per stage first, as each stage's figure is shown


@dataclass(frozen=True)
class Block:
    """One block of the document: a heading, a paragraph, a note, a table, a figure or a link (`href`)."""

    kind: str
    text: str = ""
    headers: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    href: str = ""
