"""The cycle report researchers read: Markdown and a self-contained HTML page with PNG figures.

Sections: what the cycle ran with (task catalogue identity, prompt-template hashes), RHI scoreboard per task (W/L/T
of each version against the bare reference, the champion marked), search coverage, invalid judge verdicts per
stage, pairwise win rates by generation with 95% intervals (per split, task and judge), judge agreement by
generation, public benchmarks with score per output token, training and validation loss curves, tokens and cost per
stage, wall-clock and GPU-hours per stage — and an explicit note for every task the config let into teacher
collection although its workflow never beat the reference (the demo preset does this).

Everything is read from the metadata store and the artifact store; nothing is recomputed by calling a model. The
page stands alone (opened from S3, mailed as an attachment): inline CSS, no scripts, every figure embedded as a
``data:image/png;base64`` image. Each embedded figure is also a link to its PNG, published next to the page under
``figures/`` before the page (so the page never references a missing file); the Markdown references those files.
matplotlib is imported only here, on the Agg canvas, without pyplot's global state.
"""

from __future__ import annotations

import base64
import html
import re
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from mass_ops.context import CycleContext
from mass_ops.evaluation.agreement import Agreement
from mass_ops.evaluation.benchmarks.mlr import MLR, summarize_mlr
from mass_ops.evaluation.benchmarks.scoring import BenchmarkError, TrialResult, recorded_trials, summarize_trials
from mass_ops.evaluation.benchmarks.table import HEADERS as BENCHMARK_TABLE_HEADERS
from mass_ops.evaluation.benchmarks.table import BenchmarkCell, benchmark_table, draw_benchmark_table, table_rows
from mass_ops.evaluation.efficiency import Efficiency, score_per_output_token
from mass_ops.evaluation.position_bias import FlipRate, flip_rates, order_checks
from mass_ops.evaluation.stats import LedgerKeyError, PairwiseSummary, WinRate, format_rate, parse_ledger_key
from mass_ops.layout import PAIRWISE_KIND, episode_name, report_prefix, teacher_condition, training_prefix
from mass_ops.llm.calls import CallLedger
from mass_ops.prompts import shipped_prompts
from mass_ops.search.champion import BASELINE_WIN, derive_champion
from mass_ops.store.schema import CallStatus, Ledger, TrainingRun
from mass_ops.train.checkpoints import finite_number, log_rows

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
_BASELINE_KEY = re.compile(r"^v(\d+)_vs_no_harness$")
_ARBITRATION_KEY = re.compile(r"^champion_v(\d+)_vs_v(\d+)$")
EPISODE_STAGE = {
    "reference": "search",
    "search": "search",
    "collection": "collect",
    "rollout": "evaluate",
    "benchmark": "benchmark",
}
CALL_STAGE = {"judge": "search", "optimizer": "search", "arbitration": "search", "self_judge": "rank"}
STAGE_ORDER = ("search", "collect", "rank", "train", "evaluate", "benchmark")
# Judging stages by ledger, in the order of the cycle; evaluation rows are per judge ("evaluate: <judge>").
JUDGING_STAGES = {Ledger.RHI: "search: vs reference", Ledger.CHAMPION: "search: arbitration", Ledger.RANKING:
                  "rank: self-judge"}  # fmt: skip
PROMPT_DIGEST_CHARS = 16
_COLOURS = {"W": "#4c9a5f", "L": "#c8553d", "T": "#b8b8b8"}


# -- data ------------------------------------------------------------------------------------------------------------


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
class StageCost:
    """Token, cost and time totals of one stage."""

    stage: str
    calls: int = 0
    call_prompt_tokens: int = 0
    call_completion_tokens: int = 0
    cost_usd: float | None = None
    episodes: int = 0
    agent_prompt_tokens: int = 0
    agent_completion_tokens: int = 0
    busy_s: float = 0.0
    span_s: float = 0.0
    gpu_hours: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return self.call_prompt_tokens + self.agent_prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.call_completion_tokens + self.agent_completion_tokens


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
        return _median([v for _, v in self.tokens_per_s])


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


def _median(values: Sequence[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


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
    estimate_rows: list[EstimateRow] = field(default_factory=list)
    estimate_source: str | None = None

    @property
    def own_evaluations(self) -> list[PairwiseEvaluation]:
        return [e for e in self.evaluations if e.cycle == self.cycle]


def _training_runs(ctx: CycleContext) -> list[TrainingRun]:
    # The repository has no listing of a cycle's training runs; this read-only query is the report's own.
    with ctx.repo.store.read() as session:
        statement = sa.select(TrainingRun).where(TrainingRun.cycle_id == ctx.cycle_id).order_by(TrainingRun.id)
        return list(session.scalars(statement).all())


def _scoreboard(ctx: CycleContext) -> list[TaskScoreboard]:
    config = ctx.config
    repo, cycle = ctx.repo, ctx.cycle_id
    retained = {int(row.task_id): row for row in repo.retained_workflows(cycle)}
    rhi = repo.comparisons(cycle, "rhi")
    tasks = sorted(set(config.tasks.train_candidates) | {int(r.task_id) for r in rhi} | set(retained))
    search_episodes = repo.episodes(cycle, kind="search")
    boards = []
    for task in tasks:
        results: dict[int, str] = {}
        baseline: dict[int, str] = {}
        for row in rhi:
            found = _BASELINE_KEY.match(row.key)
            if int(row.task_id) == task and found:
                version = int(found.group(1))
                baseline[version] = row.verdict
                results[version] = "W" if row.verdict == BASELINE_WIN else "L" if row.verdict == "A" else "T"
        arbitration: dict[tuple[int, int], str] = {}
        for row in repo.comparisons(cycle, "champion", task_id=task):
            found = _ARBITRATION_KEY.match(row.key)
            if found:
                arbitration[(int(found.group(1)), int(found.group(2)))] = row.verdict
        row = retained.get(task)
        if row is not None:
            champion = row.version if row.beats_reference else None
        elif baseline:
            champion = derive_champion(baseline, arbitration, max(baseline)).retained
        else:
            champion = None
        executed = len({e.version for e in search_episodes if int(e.task_id) == task and e.status != "infra_failure"})
        boards.append(
            TaskScoreboard(
                task=task,
                split="test" if task in config.tasks.test else "train",
                results=dict(sorted(results.items())),
                champion=champion,
                executed=executed,
                planned=config.search.iterations + 1,
                retained_recorded=row is not None,
            )
        )
    return boards


def _provenance(ctx: CycleContext) -> tuple[str, dict[str, Any] | None, list[PromptDigest]]:
    """(catalogue identity, its import record, prompt templates) as the cycle row recorded them at open time."""
    cycle = ctx.repo.get_cycle(ctx.cycle_name)
    recorded = (cycle.provenance if cycle is not None else None) or {}
    catalogue = recorded.get("catalogue") if isinstance(recorded.get("catalogue"), dict) else {}
    identity = str(catalogue.get("identity") or "not recorded")
    imported = catalogue.get("provenance") if isinstance(catalogue.get("provenance"), dict) else None
    prompts = recorded.get("prompts") if isinstance(recorded.get("prompts"), dict) else {}
    shipped = shipped_prompts().digests()
    digests = [
        PromptDigest(str(name), str(sha), None if name not in shipped else shipped[name] == sha)
        for name, sha in sorted(prompts.items())
    ]
    return identity, imported, digests


def _judging_stage(ledger: str, key: str) -> str | None:
    """The report's stage name of a verdict (its ledger and key), or None for a key it cannot place."""
    if ledger != Ledger.EXTERNAL:
        return JUDGING_STAGES.get(Ledger(ledger))
    try:
        return f"evaluate: {parse_ledger_key(key)[1]}"
    except LedgerKeyError:
        return None


def _judge_validity(ctx: CycleContext) -> list[JudgeValidity]:
    """Verdicts, invalid verdicts and unusable answers per judging stage (stages without a verdict are left out)."""
    verdicts: dict[str, int] = defaultdict(int)
    invalid: dict[str, int] = defaultdict(int)
    unusable: dict[str, int] = defaultdict(int)
    for ledger in Ledger:
        for row in ctx.repo.comparisons(ctx.cycle_id, ledger):
            stage = _judging_stage(ledger, row.key)
            if stage is not None:
                verdicts[stage] += 1
                invalid[stage] += row.verdict == "invalid"
    for call in ctx.repo.llm_calls(ctx.cycle_id):
        if call.status != CallStatus.INVALID:
            continue
        # Attempt keys: task<q>/<ledger>/<key>[/swapped]/a<n> in the inner loop, eval/external/<key>/a<n> in evaluate.
        parts = call.unit_key.split("/")
        if parts[0] == "eval" and len(parts) >= 5:
            stage = _judging_stage(Ledger.EXTERNAL, "/".join(parts[2:5]))
        elif len(parts) >= 3 and parts[1] in JUDGING_STAGES:
            stage = _judging_stage(parts[1], parts[2])
        else:
            stage = None  # an optimizer answer, reported with the search's own notes
        if stage is not None:
            unusable[stage] += 1
    order = [*JUDGING_STAGES.values()]
    stages = sorted(set(verdicts) | set(unusable), key=lambda s: (order.index(s) if s in order else len(order), s))
    return [JudgeValidity(s, verdicts[s], invalid[s], unusable[s]) for s in stages]


def _let_through_notes(ctx: CycleContext) -> list[str]:
    """Tasks allowed into teacher collection although their workflow never beat the reference."""
    config = ctx.config
    if config.collection.require_beats_reference:
        return []
    notes = []
    retained = {int(row.task_id): row for row in ctx.repo.retained_workflows(ctx.cycle_id)}
    for task in config.tasks.train:
        row = retained.get(task)
        if row is None or row.beats_reference:
            continue
        collected = len(ctx.repo.episodes(ctx.cycle_id, task_id=task, kind="collection"))
        notes.append(
            f"Task {task}: its workflow search never beat the bare reference (no version won), yet the "
            f"{config.preset} preset sets collection.require_beats_reference: false and let it through to teacher "
            f"collection ({collected} collection episode(s) recorded). Its teacher trajectories come from workflow "
            f"v{row.last_evaluated_version if row.version is None else row.version}, which the judge did not prefer "
            "to the reference; the paper presets would have skipped it."
        )
    return notes


def _carried_design_notes(ctx: CycleContext) -> list[str]:
    """Versions whose design repeats their parent's because the optimizer's answer was unusable (keep_design)."""
    if ctx.config.search.on_invalid_proposal != "keep_design":
        return []
    notes = []
    for task in ctx.config.tasks.train_candidates:
        versions = {v.version: v for v in ctx.repo.workflow_versions(ctx.cycle_id, task)}
        carried = [
            f"v{v.version}"
            for v in versions.values()
            if v.parent_version is not None
            and v.parent_version in versions
            and v.design == versions[v.parent_version].design
        ]
        if carried:
            notes.append(
                f"Task {task}: {', '.join(carried)} repeat their parent's design because the optimizer's answer was "
                f"not usable and the {ctx.config.preset} preset sets search.on_invalid_proposal: keep_design; the "
                "paper presets fail the step instead."
            )
    return notes


def _evaluations(ctx: CycleContext) -> list[PairwiseEvaluation]:
    found = []
    for row in ctx.repo.evaluations(kind=PAIRWISE_KIND):
        results = row.results or {}
        try:
            summary = PairwiseSummary.from_dict(results["summary"])
        except (KeyError, TypeError, ValueError):
            continue
        model = ctx.repo.get_generation(str(results.get("generation_a")))
        order = (model.generation if model else 10**6, row.created_at.timestamp() if row.created_at else 0, row.id)
        found.append(
            PairwiseEvaluation(
                key=row.key,
                label=str(results.get("label", row.key)),
                cycle=str(results.get("cycle", "")),
                generation_a=str(results.get("generation_a")),
                generation_b=str(results.get("generation_b")),
                order=(int(order[0]), int(order[1]), int(order[2])),
                pairs=int(results.get("pairs", 0)),
                judges=list(results.get("judges") or []),
                seeds=list(results.get("seeds") or []),
                summary=summary,
                agreement={k: Agreement.from_dict(v) for k, v in (results.get("agreement") or {}).items()},
            )
        )
    return sorted(found, key=lambda e: e.order)


def _evaluation_notes(ctx: CycleContext) -> list[str]:
    """The notes recorded with this cycle's pairwise evaluations (e.g. that a stand-in judge judged)."""
    return [
        f"Evaluation {row.results.get('label', row.key)}: {row.results['note']}"
        for row in ctx.repo.evaluations(kind=PAIRWISE_KIND)
        if row.cycle_id == ctx.cycle_id and isinstance(row.results, dict) and row.results.get("note")
    ]


def _rollout_tokens(ctx: CycleContext) -> dict[str, tuple[int, float | None]]:
    groups: dict[str, list[int | None]] = defaultdict(list)
    for episode in ctx.repo.episodes(ctx.cycle_id, kind="rollout"):
        groups[episode.generation or "?"].append(episode.completion_tokens)
    result = {}
    for generation, tokens in sorted(groups.items()):
        known = [t for t in tokens if t is not None]
        result[generation] = (len(tokens), sum(known) / len(known) if known else None)
    return result


def _benchmarks(ctx: CycleContext) -> tuple[list[tuple[str, str, str, int, str]], list[Efficiency], list[str]]:
    trials = recorded_trials(ctx)
    groups: dict[tuple[str, str], list[TrialResult]] = defaultdict(list)
    for trial in trials:
        groups[(trial.benchmark, trial.generation)].append(trial)
    rows, notes = [], []
    for (benchmark, generation), results in sorted(groups.items()):
        try:
            summary = summarize_mlr(results) if benchmark == MLR else summarize_trials(results)
        except BenchmarkError as exc:
            notes.append(f"Benchmark {benchmark} of {generation} is incomplete: {exc}")
            rows.append((benchmark, generation, "incomplete", len(results), "n/a"))
            continue
        scale = 100.0 if benchmark == "sab" else 1.0
        unit = "success %" if benchmark == "sab" else "mean Overall (0-10)"
        rows.append((benchmark, generation, unit, summary.trials, summary.format(scale, 2)))
    scored = [item for trial in trials for item in trial.scored_episodes()]
    episodes = {e.id: e for e in ctx.repo.episodes(ctx.cycle_id, kind="benchmark")}
    return rows, score_per_output_token(scored, episodes), notes


def _read_log_rows(ctx: CycleContext, run: TrainingRun) -> list[dict[str, Any]]:
    """Rows of the run's training log when it is in the artifact store (log_uri, else the cycle's training
    folder); an unreadable log leaves the curve to the checkpoint rows."""
    keys = []
    if run.log_uri:
        try:
            key = ctx.artifacts.key_of(run.log_uri)
            keys.append(key if key.endswith(".jsonl") else f"{key.rstrip('/')}/train_log.jsonl")
        except ValueError:
            pass
    keys.append(f"{training_prefix(ctx.cycle_name)}/{run.key}/train_log.jsonl")
    for key in keys:
        if ctx.artifacts.exists(key):
            return log_rows(ctx.artifacts.get_bytes(key).decode("utf-8", errors="replace"), key, strict=False)
    return []


def _curves(ctx: CycleContext, runs: Sequence[TrainingRun]) -> list[LossCurve]:
    curves = []
    for run in runs:
        train: dict[int, float] = {}
        val: dict[int, float] = {}
        for row in _read_log_rows(ctx, run):
            step = row.get("step")
            if not isinstance(step, int):
                continue
            if finite_number(row.get("val_loss")):
                val[step] = float(row["val_loss"])
            elif finite_number(row.get("loss")):
                train[step] = float(row["loss"])
        for checkpoint in ctx.repo.checkpoints(run.id):
            if checkpoint.val_loss is not None and checkpoint.step not in val:
                val[checkpoint.step] = checkpoint.val_loss
            if checkpoint.train_loss is not None and checkpoint.step not in train:
                train[checkpoint.step] = checkpoint.train_loss
        best = ctx.repo.best_checkpoint(run.id)
        curves.append(
            LossCurve(
                run=run.key,
                train=sorted(train.items()),
                val=sorted(val.items()),
                selected_step=best.step if best else None,
                selected_val_loss=best.val_loss if best else None,
            )
        )
    return curves


def _span(intervals: Iterable[tuple[datetime, datetime]]) -> float:
    """Seconds covered by the union of the intervals: the stage's wall-clock, without the idle gaps between a run
    and its rerun days later."""
    total = 0.0
    current: tuple[datetime, datetime] | None = None
    for start, end in sorted(intervals):
        if current is not None and start <= current[1]:
            current = (current[0], max(current[1], end))
            continue
        if current is not None:
            total += (current[1] - current[0]).total_seconds()
        current = (start, end)
    if current is not None:
        total += (current[1] - current[0]).total_seconds()
    return max(0.0, total)


def _stages(ctx: CycleContext, runs: Sequence[TrainingRun]) -> list[StageCost]:
    """Tokens, cost and time per stage. GPU-hours: the inference server's GPUs over the stage's span for stages
    that use it (episodes and in-loop calls), the training ranks (one GPU each) over a run's wall-clock."""
    config = ctx.config
    server_gpus = config.inference.server.gpus
    totals: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(float))
    intervals: dict[str, list[tuple[datetime, datetime]]] = defaultdict(list)  # all work of the stage
    on_server: dict[str, list[tuple[datetime, datetime]]] = defaultdict(list)  # work on our inference server
    costs: dict[str, list[float]] = defaultdict(list)
    for call in ctx.repo.llm_calls(ctx.cycle_id):
        # External judges run elsewhere and cost us no GPU time; every other call is served by our model.
        in_loop = call.purpose in CALL_STAGE
        stage = "evaluate" if call.unit_key.startswith("eval/") else CALL_STAGE.get(call.purpose, "evaluate")
        bucket = totals[stage]
        bucket["calls"] += 1
        bucket["call_prompt_tokens"] += call.prompt_tokens or 0
        bucket["call_completion_tokens"] += call.completion_tokens or 0
        bucket["busy_s"] += call.latency_s or 0.0
        if call.cost_usd is not None:
            costs[stage].append(call.cost_usd)
        if call.created_at is not None:
            start = datetime.fromtimestamp(call.created_at.timestamp() - (call.latency_s or 0.0), UTC)
            intervals[stage].append((start, call.created_at))
            if in_loop:
                on_server[stage].append((start, call.created_at))
    for episode in ctx.repo.episodes(ctx.cycle_id):
        stage = EPISODE_STAGE.get(episode.kind, episode.kind)
        bucket = totals[stage]
        bucket["episodes"] += 1
        bucket["agent_prompt_tokens"] += episode.prompt_tokens or 0
        bucket["agent_completion_tokens"] += episode.completion_tokens or 0
        bucket["busy_s"] += episode.duration_s or 0.0
        if episode.started_at is not None and episode.finished_at is not None:
            intervals[stage].append((episode.started_at, episode.finished_at))
            on_server[stage].append((episode.started_at, episode.finished_at))
    gpus: dict[str, float] = defaultdict(float)
    for stage, spans in on_server.items():
        gpus[stage] = _span(spans) / 3600 * server_gpus
    train_span = []
    for run in runs:
        if run.started_at is not None and run.finished_at is not None:
            wall = (run.finished_at - run.started_at).total_seconds()
            totals["train"]["busy_s"] += wall
            gpus["train"] += wall / 3600 * config.training.replicas
            train_span.append((run.started_at, run.finished_at))
    stages = []
    for stage in STAGE_ORDER:
        bucket = totals.get(stage)
        if bucket is None and stage not in gpus:
            continue
        bucket = bucket or {}
        spans = intervals.get(stage, []) + (train_span if stage == "train" else [])
        stages.append(
            StageCost(
                stage=stage,
                calls=int(bucket.get("calls", 0)),
                call_prompt_tokens=int(bucket.get("call_prompt_tokens", 0)),
                call_completion_tokens=int(bucket.get("call_completion_tokens", 0)),
                cost_usd=sum(costs[stage]) if costs.get(stage) else None,
                episodes=int(bucket.get("episodes", 0)),
                agent_prompt_tokens=int(bucket.get("agent_prompt_tokens", 0)),
                agent_completion_tokens=int(bucket.get("agent_completion_tokens", 0)),
                busy_s=float(bucket.get("busy_s", 0.0)),
                span_s=_span(spans),
                gpu_hours=gpus.get(stage, 0.0),
            )
        )
    return stages


def _flip_rates(ctx: CycleContext) -> list[FlipRate]:
    """Flip rates per judging stage and judge, from the pairs the ledger holds in both presentations."""
    ledger = CallLedger(ctx.repo, ctx.artifacts, ctx.cycle_id, ctx.cycle_name)
    return flip_rates(order_checks(ledger, ctx.repo.llm_calls(ctx.cycle_id)))


def _rankings(ctx: CycleContext) -> list[RankedTrajectory]:
    """Every ranked trajectory of the cycle, by task then rank, named as the rank stage names them."""
    seeds = {e.id: e.seed for e in ctx.repo.episodes(ctx.cycle_id, kind="collection")}
    tasks = sorted({int(t) for t in ctx.config.tasks.train} | {int(t) for t in ctx.config.tasks.train_candidates})
    rows = []
    for task in tasks:
        condition = teacher_condition(task, ctx.config.generation)
        for row in sorted(ctx.repo.rankings(ctx.cycle_id, task), key=lambda r: r.rank):
            seed = seeds.get(row.episode_id)
            name = episode_name(condition, seed) if seed is not None else f"episode {row.episode_id}"
            rows.append(RankedTrajectory(task, name, row.rank, row.score, row.ci_low, row.ci_high))
    return rows


def _number(value: Any) -> float | None:
    return float(value) if finite_number(value) else None


def _throughput(ctx: CycleContext, runs: Sequence[TrainingRun]) -> list[ThroughputCurve]:
    """The throughput fields the trainer logs per step (runs whose log has none are left out)."""
    curves = []
    for run in runs:
        tokens, supervised, mfu, peaks = [], [], [], []
        for row in _read_log_rows(ctx, run):
            step = row.get("step")
            if not isinstance(step, int) or "val_loss" in row:
                continue
            for name, series in (("tokens_per_s", tokens), ("supervised_tokens_per_s", supervised), ("mfu", mfu)):
                value = _number(row.get(name))
                if value is not None:
                    series.append((step, value))
            peak = _number(row.get("peak_mem_gib"))
            if peak is not None:
                peaks.append(peak)
        if tokens:
            curves.append(ThroughputCurve(run.key, tokens, supervised, mfu, max(peaks) if peaks else None))
    return curves


def _cached_tokens(row: Any, usage: Mapping[str, Any] | None) -> int | None:
    """Cached prompt tokens of a call or episode: its own column when recorded, else the server's
    ``usage.prompt_tokens_details.cached_tokens``; None when the server did not report any."""
    value = getattr(row, "cached_prompt_tokens", None)
    if value is None and isinstance(usage, Mapping):
        details = usage.get("prompt_tokens_details")
        value = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _cache_shares(ctx: CycleContext) -> list[CacheShare]:
    """Prompt-cache shares per stage; empty when no unit of the cycle reported cached tokens."""
    units: dict[str, int] = defaultdict(int)
    reporting: dict[str, int] = defaultdict(int)
    cached: dict[str, int] = defaultdict(int)
    prompt: dict[str, int] = defaultdict(int)

    def add(stage: str, hits: int | None, prompt_tokens: int | None) -> None:
        units[stage] += 1
        if hits is not None and prompt_tokens:
            reporting[stage] += 1
            cached[stage] += hits
            prompt[stage] += prompt_tokens

    for call in ctx.repo.llm_calls(ctx.cycle_id):
        stage = "evaluate" if call.unit_key.startswith("eval/") else CALL_STAGE.get(call.purpose, "evaluate")
        add(stage, _cached_tokens(call, call.usage), call.prompt_tokens)
    for episode in ctx.repo.episodes(ctx.cycle_id):
        add(EPISODE_STAGE.get(episode.kind, episode.kind), _cached_tokens(episode, None), episode.prompt_tokens)
    if not any(reporting.values()):
        return []
    order = {stage: i for i, stage in enumerate(STAGE_ORDER)}
    return [
        CacheShare(stage, units[stage], reporting[stage], cached[stage], prompt[stage])
        for stage in sorted(units, key=lambda s: (order.get(s, len(order)), s))
    ]


def collect_report_data(ctx: CycleContext, now: datetime | None = None) -> ReportData:
    """Gather the report's content from the stores."""
    config = ctx.config
    data = ReportData(
        cycle=ctx.cycle_name,
        preset=config.preset,
        generation=config.generation,
        served_model=config.models.served_name,
        config_hash=config.config_hash(),
        generated_at=(now or datetime.now(UTC)).strftime("%Y-%m-%d %H:%M UTC"),
        max_invalid_fraction=config.judge.max_invalid_fraction,
    )
    data.catalogue, data.catalogue_import, data.prompts = _provenance(ctx)
    data.judging = _judge_validity(ctx)
    data.notes.extend(_let_through_notes(ctx))
    data.notes.extend(_carried_design_notes(ctx))
    data.scoreboard = _scoreboard(ctx)
    data.evaluations = _evaluations(ctx)
    data.notes.extend(_evaluation_notes(ctx))
    data.rollout_tokens = _rollout_tokens(ctx)
    data.benchmarks, data.efficiency, benchmark_notes = _benchmarks(ctx)
    data.notes.extend(benchmark_notes)
    data.benchmark_table = benchmark_table(recorded_trials(ctx), ctx.repo.episodes(ctx.cycle_id, kind="benchmark"))
    runs = _training_runs(ctx)
    data.curves = _curves(ctx, runs)
    data.stages = _stages(ctx, runs)
    data.flip_rates = _flip_rates(ctx)
    data.position_bias_sample = config.judge.position_bias_sample
    data.rankings = _rankings(ctx)
    data.throughput = _throughput(ctx, runs)
    data.cache_shares = _cache_shares(ctx)
    data.budgets, data.estimate_rows, data.estimate_source = _cost_control(ctx, data.stages)
    if not data.own_evaluations:
        data.notes.append("No pairwise evaluation of this cycle is recorded yet (rollouts → pairs → judges → summary).")
    return data


# -- figures ---------------------------------------------------------------------------------------------------------


def _new_figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _empty(ax: Any, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=11, color="#666666", transform=ax.transAxes)
    ax.set_axis_off()


def _scoreboard_figure(data: ReportData) -> Any:
    from matplotlib.patches import Rectangle

    boards = data.scoreboard
    versions = sorted({v for b in boards for v in b.results} | {v for b in boards for v in range(b.planned)})
    figure = _new_figure(max(6.0, 1.2 + 0.55 * len(versions)), max(2.4, 0.9 + 0.45 * len(boards)))
    ax = figure.subplots()
    if not boards:
        _empty(ax, "No RHI search recorded")
        return figure
    for row, board in enumerate(boards):
        for column, version in enumerate(versions):
            result = board.results.get(version)
            colour = _COLOURS.get(result or "", "#ffffff")
            ax.add_patch(Rectangle((column, row), 1, 1, facecolor=colour, edgecolor="#dddddd"))
            if result:
                ax.text(column + 0.5, row + 0.5, result, ha="center", va="center", fontsize=9, color="white")
            if board.champion == version:
                ax.add_patch(Rectangle((column, row), 1, 1, fill=False, edgecolor="black", linewidth=2.5))
                ax.text(column + 0.88, row + 0.22, "★", ha="center", va="center", fontsize=9, color="black")
    ax.set_xlim(0, len(versions))
    ax.set_ylim(len(boards), 0)
    ax.set_xticks([c + 0.5 for c in range(len(versions))], [f"v{v}" for v in versions])
    ax.set_yticks([r + 0.5 for r in range(len(boards))], [f"task {b.task} ({b.split})" for b in boards])
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title("Each version vs the bare reference: W win, L loss, T tie (★ champion)", fontsize=10)
    return figure


def _coverage_figure(data: ReportData) -> Any:
    boards = data.scoreboard
    figure = _new_figure(max(6.0, 1.0 + 0.9 * len(boards)), 3.6)
    ax = figure.subplots()
    if not boards:
        _empty(ax, "No RHI search recorded")
        return figure
    x = list(range(len(boards)))
    series = (
        ("planned", [b.planned for b in boards], "#d9d9d9"),
        ("executed", [b.executed for b in boards], "#7aa6c2"),
        ("judged", [len(b.results) for b in boards], "#3d6f94"),
        ("beat reference", [b.wins for b in boards], "#4c9a5f"),
    )
    width = 0.2
    for index, (name, values, colour) in enumerate(series):
        ax.bar([i + (index - 1.5) * width for i in x], values, width, label=name, color=colour)
    ax.set_xticks(x, [str(b.task) for b in boards])
    ax.set_xlabel("task")
    ax.set_ylabel("workflow versions")
    ax.legend(fontsize=8, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    return figure


def _rate_point(rate: WinRate) -> tuple[float, float, float] | None:
    if rate.win_rate is None:
        return None
    low, high = rate.bootstrap or rate.wilson or (rate.win_rate, rate.win_rate)
    return rate.win_rate, rate.win_rate - low, high - rate.win_rate


NO_DECISIVE_PAIR = "no decisive judgment yet (all ties or invalid): no win rate"


def _win_rate_figure(data: ReportData) -> Any:
    evaluations = data.evaluations
    figure = _new_figure(max(6.0, 1.5 + 1.4 * len(evaluations)), 3.8)
    ax = figure.subplots()
    if not evaluations:
        _empty(ax, "No pairwise evaluation recorded")
        return figure
    groups: list[tuple[str, Callable[[PairwiseEvaluation], WinRate | None], str, float]] = [
        ("overall", lambda e: e.summary.overall, "#222222", 0.0),
        ("train tasks", lambda e: e.summary.by_split.get("train"), "#3d6f94", -0.18),
        ("test tasks", lambda e: e.summary.by_split.get("test"), "#c8553d", 0.18),
    ]
    plotted = False
    for name, pick, colour, offset in groups:
        xs, ys, lows, highs = [], [], [], []
        for index, evaluation in enumerate(evaluations):
            rate = pick(evaluation)
            point = _rate_point(rate) if rate is not None else None
            if point is not None:
                xs.append(index + offset)
                ys.append(point[0])
                lows.append(point[1])
                highs.append(point[2])
        if xs:
            ax.errorbar(xs, ys, yerr=[lows, highs], fmt="o", capsize=4, color=colour, label=name)
            plotted = True
    ax.axhline(0.5, color="#999999", linestyle="--", linewidth=1)
    ax.set_ylim(-0.04, 1.06)  # room for markers and caps at 0 and 1
    ax.set_xlim(-0.6, len(evaluations) - 0.4)
    ax.set_xticks(range(len(evaluations)), [f"{e.generation_a} vs {e.generation_b}" for e in evaluations])
    ax.set_ylabel("win rate W/(W+L) of the newer model")
    if plotted:
        ax.legend(fontsize=8, loc="lower right")
    else:  # every judgment a tie or invalid: there is no win rate to draw
        ax.text(0.5, 0.75, NO_DECISIVE_PAIR, ha="center", fontsize=10, color="#666666", transform=ax.transAxes)
    ax.set_title("External judges; bars: pair-bootstrap 95% interval", fontsize=10)
    return figure


def _agreement_figure(data: ReportData) -> Any:
    points = [(e, a) for e in data.evaluations for a in e.agreement.values()]
    figure = _new_figure(max(6.0, 1.5 + 1.4 * len(points)), 3.6)
    ax = figure.subplots()
    if not points:
        _empty(ax, "No self-judge verdicts on evaluation pairs recorded")
        return figure
    x = list(range(len(points)))
    raw = [a.rate or 0.0 for _, a in points]
    decisive = [a.decisive_rate or 0.0 for _, a in points]
    ax.bar([i - 0.15 for i in x], raw, 0.3, label="agreement (A/B/tie)", color="#3d6f94")
    ax.bar([i + 0.15 for i in x], decisive, 0.3, label="agreement on decisive pairs", color="#7aa6c2")
    for i, (_, agreement) in enumerate(points):
        kappa = "n/a" if agreement.kappa is None else f"{agreement.kappa:.2f}"
        ax.text(i, 1.03, f"n={agreement.pairs}, κ={kappa}", ha="center", fontsize=8)
    ax.set_ylim(0, 1.12)
    ax.set_xlim(-0.7, len(points) - 0.3)
    ax.set_xticks(x, [f"{e.generation_a} vs {e.generation_b}" for e, _ in points])
    ax.set_ylabel("fraction of pairs")
    ax.legend(fontsize=8, ncols=2, loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    ax.set_title("In-loop self-judge vs external majority", fontsize=10)
    return figure


def _loss_figure(data: ReportData) -> Any:
    figure = _new_figure(7.0, 3.8)
    ax = figure.subplots()
    curves = [c for c in data.curves if c.train or c.val]
    if not curves:
        _empty(ax, "No training run recorded")
        return figure
    for curve in curves:
        if curve.train:
            ax.plot(*zip(*curve.train, strict=True), label=f"{curve.run} train", linewidth=1.2)
        if curve.val:
            ax.plot(*zip(*curve.val, strict=True), marker="o", label=f"{curve.run} validation", linewidth=1.2)
        if curve.selected_step is not None and curve.selected_val_loss is not None:
            ax.scatter([curve.selected_step], [curve.selected_val_loss], s=120, facecolors="none", edgecolors="black")
            ax.annotate(
                f"selected step {curve.selected_step}",
                (curve.selected_step, curve.selected_val_loss),
                textcoords="offset points",
                xytext=(8, 8),
                fontsize=8,
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (token mean)")
    ax.legend(fontsize=8)
    return figure


def _ranking_figure(data: ReportData) -> Any:
    """One panel per ranked task: each trajectory's Bradley–Terry score with its bootstrap interval, best on top."""
    tasks = sorted({r.task for r in data.rankings})
    columns = min(3, max(1, len(tasks)))
    rows = max(1, -(-len(tasks) // columns))
    per_panel = max((sum(1 for r in data.rankings if r.task == t) for t in tasks), default=1)
    figure = _new_figure(3.4 * columns + 0.6, max(2.6, 0.22 * per_panel + 1.2) * rows)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    if not tasks:
        _empty(axes[0], "No ranking recorded")
        return figure
    for ax, task in zip(axes, tasks, strict=False):
        ranked = sorted((r for r in data.rankings if r.task == task), key=lambda r: r.rank)
        y = list(range(len(ranked)))[::-1]
        scores = [r.score for r in ranked]
        has_ci = [r.ci_low is not None and r.ci_high is not None for r in ranked]
        # A bootstrap percentile interval need not contain the point estimate (a fit on all matches can lie outside
        # the resampled fits' range, e.g. when every verdict is a tie): draw the interval's side that exists.
        lower = [max(0.0, r.score - r.ci_low) if ok else 0.0 for r, ok in zip(ranked, has_ci, strict=True)]  # type: ignore[operator]
        upper = [max(0.0, r.ci_high - r.score) if ok else 0.0 for r, ok in zip(ranked, has_ci, strict=True)]  # type: ignore[operator]
        ax.errorbar(scores, y, xerr=[lower, upper], fmt="o", color="#3d6f94", ecolor="#7aa6c2", capsize=2)
        ax.set_yticks(y, [f"{r.rank}. {r.name}" for r in ranked], fontsize=7)
        ax.axvline(0.0, color="#999999", linewidth=0.6)
        ax.set_title(f"task {task}", fontsize=9)
        ax.set_xlabel("Bradley–Terry score", fontsize=8)
    for ax in axes[len(tasks) :]:
        ax.set_axis_off()
    return figure


def _throughput_figure(data: ReportData) -> Any:
    """Tokens/s (all tokens and supervised ones) per step, and MFU where the trainer computed it."""
    figure = _new_figure(9.0, 3.6)
    left, right = figure.subplots(1, 2)
    if not data.throughput:
        _empty(left, "No training throughput logged")
        right.set_axis_off()
        return figure
    for curve in data.throughput:
        left.plot(*zip(*curve.tokens_per_s, strict=True), label=f"{curve.run} tokens/s", linewidth=1.2)
        if curve.supervised_tokens_per_s:
            left.plot(
                *zip(*curve.supervised_tokens_per_s, strict=True),
                label=f"{curve.run} supervised tokens/s",
                linewidth=1.0,
                linestyle="--",
            )
    left.set_xlabel("optimizer step")
    left.set_ylabel("tokens/s (all ranks)")
    left.legend(fontsize=8)
    with_mfu = [c for c in data.throughput if c.mfu]
    if not with_mfu:
        _empty(right, "MFU not computed (no architecture or no training.peak_tflops_per_gpu)")
        return figure
    for curve in with_mfu:
        right.plot([s for s, _ in curve.mfu], [100 * v for _, v in curve.mfu], label=curve.run, linewidth=1.2)
    right.set_xlabel("optimizer step")
    right.set_ylabel("MFU (%)")
    right.legend(fontsize=8)
    return figure


def _tokens_figure(data: ReportData) -> Any:
    stages = [s for s in data.stages if s.prompt_tokens or s.completion_tokens]
    figure = _new_figure(7.0, 3.8)
    ax = figure.subplots()
    if not stages:
        _empty(ax, "No token accounting recorded")
        return figure
    x = list(range(len(stages)))
    prompt = [s.prompt_tokens for s in stages]
    completion = [s.completion_tokens for s in stages]
    ax.bar(x, prompt, 0.6, label="prompt tokens", color="#7aa6c2")
    ax.bar(x, completion, 0.6, bottom=prompt, label="completion tokens", color="#3d6f94")
    top = max(p + c for p, c in zip(prompt, completion, strict=True))
    for i, stage in enumerate(stages):
        cost = "cost n/a" if stage.cost_usd is None else f"${stage.cost_usd:,.2f}"
        ax.text(i, prompt[i] + completion[i] + top * 0.02, cost, ha="center", fontsize=8)
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks(x, [s.stage for s in stages])
    ax.set_ylabel("tokens (LLM calls + agent episodes)")
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _position: f"{value:,.0f}"))
    ax.legend(fontsize=8)
    return figure


def _time_figure(data: ReportData) -> Any:
    stages = [s for s in data.stages if s.span_s or s.busy_s or s.gpu_hours]
    figure = _new_figure(9.0, 3.8)
    left, right = figure.subplots(1, 2)
    if not stages:
        _empty(left, "No timings recorded")
        right.set_axis_off()
        return figure
    x = list(range(len(stages)))
    left.bar([i - 0.18 for i in x], [s.span_s / 3600 for s in stages], 0.36, label="wall-clock", color="#3d6f94")
    left.bar([i + 0.18 for i in x], [s.busy_s / 3600 for s in stages], 0.36, label="summed unit time", color="#7aa6c2")
    left.set_xticks(x, [s.stage for s in stages], rotation=30, ha="right")
    left.set_ylabel("hours")
    left.legend(fontsize=8)
    right.bar(x, [s.gpu_hours for s in stages], 0.6, color="#c8553d")
    right.set_xticks(x, [s.stage for s in stages], rotation=30, ha="right")
    right.set_ylabel("GPU-hours")
    return figure


def _benchmark_table_figure(data: ReportData) -> Any:
    """The paper's benchmark table as bars: score mean ± SD, and score per output token relative to L0."""
    return draw_benchmark_table(data.benchmark_table, _new_figure(10.0, 3.6))


def _benchmark_table_blocks(data: ReportData) -> list[Block]:
    """The paper's layout: per benchmark, each generation's score, attempted/scored tasks, tokens and the ratio."""
    if not data.benchmark_table:
        return [Block("figure", "benchmark_table")]  # every figure is in the document; this one says it is empty
    return [
        Block("h3", "By generation (the paper's table)"),
        Block("table", headers=BENCHMARK_TABLE_HEADERS, rows=table_rows(data.benchmark_table)),
        Block("figure", "benchmark_table"),
    ]


FIGURE_BUILDERS: dict[str, Callable[[ReportData], Any]] = {
    "rhi_scoreboard": _scoreboard_figure,
    "search_coverage": _coverage_figure,
    "win_rate_by_generation": _win_rate_figure,
    "judge_agreement": _agreement_figure,
    "ranking_scores": _ranking_figure,
    "loss_curves": _loss_figure,
    "training_throughput": _throughput_figure,
    "tokens_cost": _tokens_figure,
    "wallclock_gpu": _time_figure,
    "benchmark_table": _benchmark_table_figure,
}


def render_figures(data: ReportData, folder: Path) -> dict[str, Path]:
    """Every figure as a PNG in `folder` (a figure without data says so rather than being left out)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, _title in FIGURES:
        figure = FIGURE_BUILDERS[name](data)
        path = folder / f"{name}.png"
        figure.savefig(path, format="png")
        paths[name] = path
    return paths


# -- document --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One block of the document: a heading, a paragraph, a note, a table or a figure."""

    kind: str
    text: str = ""
    headers: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _int(value: int) -> str:
    return f"{value:,}"


def _rate_row(name: str, rate: WinRate) -> tuple[str, ...]:
    return (
        name,
        str(rate.wins),
        str(rate.losses),
        str(rate.ties),
        _fmt(rate.win_rate),
        "n/a" if rate.wilson is None else f"[{rate.wilson[0]:.2f}, {rate.wilson[1]:.2f}]",
        "n/a" if rate.bootstrap is None else f"[{rate.bootstrap[0]:.2f}, {rate.bootstrap[1]:.2f}]",
    )


RATE_HEADERS = ("group", "W", "L", "T", "W/(W+L)", "Wilson 95%", "pair bootstrap 95%")


def build_blocks(data: ReportData) -> list[Block]:
    """The report as blocks, rendered to both Markdown and HTML."""
    blocks = [
        Block("title", f"MASS cycle report: {data.cycle}"),
        Block(
            "p",
            f"Preset {data.preset}, generation L{data.generation} → L{data.generation + 1}, served model "
            f"{data.served_model}, config {data.config_hash[:12]}. Generated {data.generated_at}.",
        ),
    ]
    blocks.extend(_provenance_blocks(data))
    blocks.extend(_cost_control_blocks(data))
    if data.notes:
        blocks.append(Block("h2", "Notes"))
        blocks.extend(Block("note", note) for note in data.notes)

    blocks.append(Block("h2", "RHI scoreboard"))
    versions = sorted({v for b in data.scoreboard for v in b.results})
    if data.scoreboard:
        rows = []
        for board in data.scoreboard:
            cells = []
            for version in versions:
                result = board.results.get(version, "")
                cells.append(f"{result}★" if board.champion == version and result else result or "·")
            champion = f"v{board.champion}" if board.champion is not None else "none"
            rows.append((str(board.task), board.split, *cells, champion, "yes" if board.champion is not None else "no"))
        headers = ("task", "split", *(f"v{v}" for v in versions), "champion", "beats reference")
        blocks.append(Block("table", headers=headers, rows=tuple(rows)))
    else:
        blocks.append(Block("p", "No RHI search is recorded for this cycle."))
    blocks.append(Block("figure", "rhi_scoreboard"))

    blocks.append(Block("h2", "Search coverage"))
    if data.scoreboard:
        rows = tuple(
            (
                str(b.task),
                str(b.planned),
                str(b.executed),
                str(len(b.results)),
                str(b.wins),
                f"{b.executed / b.planned:.0%}" if b.planned else "n/a",
            )
            for b in data.scoreboard
        )
        headers = ("task", "planned versions", "executed", "judged", "beat reference", "coverage")
        blocks.append(Block("table", headers=headers, rows=rows))
    blocks.append(Block("figure", "search_coverage"))

    blocks.append(Block("h2", "Invalid judge verdicts"))
    if data.judging:
        rows = tuple(
            (
                j.stage,
                str(j.verdicts),
                str(j.invalid),
                f"{j.invalid / j.verdicts:.1%}" if j.verdicts else "n/a",
                str(j.unusable_answers),
            )
            for j in data.judging
        )
        headers = ("stage", "verdicts", "invalid (ties)", "invalid share", "unusable answers")
        blocks.append(Block("table", headers=headers, rows=rows))
    else:
        blocks.append(Block("p", "No judge verdict is recorded for this cycle."))
    blocks.append(
        Block(
            "p",
            "An answer that is not a usable verdict is retried (judge.invalid_retries) with a seed derived from the "
            "call's; a verdict still invalid counts as a tie. A stage fails when its invalid share exceeds "
            f"judge.max_invalid_fraction = {data.max_invalid_fraction:g} (per task in search and rank, per judge in "
            "evaluate), and its rerun judges the pair again.",
        )
    )

    blocks.extend(_position_bias_blocks(data))
    blocks.extend(_ranking_blocks(data))

    blocks.append(Block("h2", "Pairwise evaluation (external judges)"))
    blocks.append(
        Block(
            "p",
            "Win rate = W/(W+L) of the newer generation (side A); ties and invalid verdicts are excluded, and the "
            "rate is n/a without a decisive judgment. Wilson treats judgments as independent; the pair bootstrap "
            "resamples pairs with all their judgments.",
        )
    )
    blocks.append(Block("figure", "win_rate_by_generation"))
    for evaluation in data.own_evaluations:
        summary = evaluation.summary
        blocks.append(
            Block(
                "h3",
                f"{evaluation.generation_a} vs {evaluation.generation_b} ({evaluation.label}): "
                f"{format_rate(summary.overall)}",
            )
        )
        blocks.append(
            Block(
                "p",
                f"{evaluation.pairs} pairs × judges {', '.join(evaluation.judges)} × presentation seeds "
                f"{', '.join(str(s) for s in evaluation.seeds)} = {summary.overall.judgments} judgments.",
            )
        )
        rows = [_rate_row("overall", summary.overall)]
        rows += [_rate_row(f"split {name}", rate) for name, rate in summary.by_split.items()]
        rows += [_rate_row(f"judge {name}", rate) for name, rate in summary.by_judge.items()]
        blocks.append(Block("table", headers=RATE_HEADERS, rows=tuple(rows)))
        task_rows = tuple(_rate_row(f"task {name}", rate) for name, rate in summary.by_task.items())
        blocks.append(Block("table", headers=RATE_HEADERS, rows=task_rows))
    if data.rollout_tokens:
        rows = tuple(
            (generation, str(count), _fmt(mean, 0)) for generation, (count, mean) in data.rollout_tokens.items()
        )
        blocks.append(Block("p", "Agent output tokens per rollout episode:"))
        blocks.append(Block("table", headers=("generation", "rollouts", "mean output tokens"), rows=rows))

    blocks.append(Block("h2", "Judge agreement"))
    agreement_rows = tuple(
        (
            f"{e.generation_a} vs {e.generation_b}",
            str(a.pairs),
            _fmt(a.rate),
            f"{a.decisive_agreements}/{a.decisive_pairs}",
            _fmt(a.decisive_rate),
            _fmt(a.kappa),
        )
        for e in data.evaluations
        for a in e.agreement.values()
    )
    if agreement_rows:
        headers = ("evaluation", "pairs", "agreement", "decisive agree", "decisive rate", "Cohen's κ")
        blocks.append(Block("table", headers=headers, rows=agreement_rows))
    else:
        blocks.append(Block("p", "No self-judge verdicts on evaluation pairs are recorded."))
    blocks.append(Block("figure", "judge_agreement"))

    blocks.append(Block("h2", "Public benchmarks"))
    if data.benchmarks:
        blocks.append(
            Block(
                "table",
                headers=("benchmark", "generation", "measure", "trials", "mean ± sample SD"),
                rows=tuple((b, g, m, str(t), v) for b, g, m, t, v in data.benchmarks),
            )
        )
        eff_rows = tuple(
            (
                e.benchmark,
                e.generation,
                f"{e.accounted}/{e.episodes}",
                _fmt(e.mean_score),
                _fmt(e.mean_output_tokens, 0),
                _fmt(e.score_per_1k_output_tokens, 4),
            )
            for e in data.efficiency
        )
        if eff_rows:
            headers = ("benchmark", "generation", "episodes with tokens", "mean score", "mean output tokens",
                       "score per 1k output tokens")  # fmt: skip
            blocks.append(Block("table", headers=headers, rows=eff_rows))
    else:
        blocks.append(Block("p", "No benchmark trial is recorded for this cycle."))
    blocks.extend(_benchmark_table_blocks(data))

    blocks.append(Block("h2", "Training"))
    if data.curves:
        rows = tuple(
            (
                c.run,
                str(max((s for s, _ in c.train), default=0)),
                _fmt(min((v for _, v in c.val), default=None), 4),
                "n/a" if c.selected_step is None else str(c.selected_step),
                _fmt(c.selected_val_loss, 4),
            )
            for c in data.curves
        )
        headers = ("run", "last logged step", "min validation loss", "selected step", "selected val loss")
        blocks.append(Block("table", headers=headers, rows=rows))
    blocks.append(Block("figure", "loss_curves"))
    blocks.extend(_throughput_blocks(data))

    blocks.append(Block("h2", "Tokens and cost per stage"))
    if data.stages:
        rows = tuple(
            (
                s.stage,
                _int(s.calls),
                _int(s.episodes),
                _int(s.prompt_tokens),
                _int(s.completion_tokens),
                "n/a" if s.cost_usd is None else f"${s.cost_usd:,.2f}",
            )
            for s in data.stages
        )
        headers = ("stage", "LLM calls", "episodes", "prompt tokens", "completion tokens", "cost (reported)")
        blocks.append(Block("table", headers=headers, rows=rows))
    blocks.append(Block("figure", "tokens_cost"))
    blocks.extend(_cache_blocks(data))

    blocks.append(Block("h2", "Wall-clock and GPU-hours per stage"))
    if data.stages:
        rows = tuple(
            (s.stage, _fmt(s.span_s / 3600, 2), _fmt(s.busy_s / 3600, 2), _fmt(s.gpu_hours, 2)) for s in data.stages
        )
        headers = ("stage", "wall-clock h", "summed unit h", "GPU-hours")
        blocks.append(Block("table", headers=headers, rows=rows))
        blocks.append(
            Block(
                "p",
                "GPU-hours: inference-server GPUs × the stage's wall-clock (time with at least one episode or in-loop "
                "call running) for stages on our server; one GPU per training rank × the run's wall-clock. External "
                "judges use no GPU of ours.",
            )
        )
    blocks.append(Block("figure", "wallclock_gpu"))
    return blocks


def _interval(bounds: tuple[float, float] | None, digits: int = 2) -> str:
    return "n/a" if bounds is None else f"[{bounds[0]:.{digits}f}, {bounds[1]:.{digits}f}]"


def _position_bias_blocks(data: ReportData) -> list[Block]:
    """Flip rate per judge: how often the verdict changes when the two workspaces swap places."""
    blocks = [Block("h2", "Judge position bias")]
    if data.flip_rates:
        rows = tuple(
            (
                r.stage,
                r.judge,
                str(r.checked),
                str(r.flips),
                _fmt(r.rate),
                _interval(r.wilson),
                str(r.reversals),
                str(r.first_shown_won_twice),
                str(r.unusable),
            )
            for r in data.flip_rates
        )
        headers = ("stage", "judge", "pairs in both orders", "flips", "flip rate", "Wilson 95%", "A/B reversals",
                   "first shown won both", "invalid in an order")  # fmt: skip
        blocks.append(Block("table", headers=headers, rows=rows))
    else:
        blocks.append(Block("p", "No pair was judged in both presentations (judge.position_bias_sample is "
                                 f"{data.position_bias_sample:g} and swap-consistent judging is off)."))  # fmt: skip
    blocks.append(
        Block(
            "p",
            "A flip: the verdict changes when A and B swap places (the swapped verdict mapped back) — a reversal, or "
            "a tie in one order and a winner in the other; a tie in both is consistent. Pairs with an invalid "
            "verdict in either order are left out. The swapped call is a measurement (judge.position_bias_sample "
            f"= {data.position_bias_sample:g} of the pairs, picked by a hash of the call key): the verdicts used for "
            "RHI and ranking are the single forward calls, as in the reference.",
        )
    )
    return blocks


def _ranking_blocks(data: ReportData) -> list[Block]:
    """Per task: the ranked trajectories and the best one's score with its bootstrap interval."""
    blocks = [Block("h2", "Ranking (self-judged tournament, Bradley–Terry)")]
    tasks = sorted({r.task for r in data.rankings})
    if tasks:
        rows = []
        for task in tasks:
            ranked = sorted((r for r in data.rankings if r.task == task), key=lambda r: r.rank)
            best = ranked[0]
            bounds = (best.ci_low, best.ci_high) if best.ci_low is not None and best.ci_high is not None else None
            widths = [r.ci_high - r.ci_low for r in ranked if r.ci_low is not None and r.ci_high is not None]
            rows.append(
                (str(task), str(len(ranked)), best.name, _fmt(best.score), _interval(bounds), _fmt(_median(widths)))
            )
        headers = ("task", "trajectories", "rank 1", "score", "95% bootstrap", "median interval width")
        blocks.append(Block("table", headers=headers, rows=tuple(rows)))
    else:
        blocks.append(Block("p", "No ranking is recorded for this cycle."))
    blocks.append(Block("figure", "ranking_scores"))
    return blocks


def _throughput_blocks(data: ReportData) -> list[Block]:
    """Median training throughput and MFU per run (the figure shows every logged step)."""
    blocks: list[Block] = []
    if data.throughput:
        rows = tuple(
            (
                c.run,
                str(len(c.tokens_per_s)),
                _fmt(c.median_tokens_per_s, 0),
                _fmt(_median([v for _, v in c.supervised_tokens_per_s]), 0),
                "n/a" if not c.mfu else f"{100 * (_median([v for _, v in c.mfu]) or 0.0):.1f}%",
                _fmt(c.peak_mem_gib, 2),
            )
            for c in data.throughput
        )
        headers = ("run", "logged steps", "median tokens/s", "median supervised tokens/s", "median MFU",
                   "peak memory GiB (rank 0)")  # fmt: skip
        blocks.append(Block("table", headers=headers, rows=rows))
    blocks.append(Block("figure", "training_throughput"))
    return blocks


def _cache_blocks(data: ReportData) -> list[Block]:
    """Prompt-cache hits per stage, when any server reported cached prompt tokens."""
    if not data.cache_shares:
        return []
    rows = tuple(
        (
            c.stage,
            f"{c.reporting}/{c.units}",
            _int(c.cached_tokens),
            _int(c.prompt_tokens),
            "n/a" if c.share is None else f"{c.share:.1%}",
        )
        for c in data.cache_shares
    )
    return [
        Block("h3", "Prompt-cache hits"),
        Block(
            "table",
            headers=("stage", "units reporting", "cached prompt tokens", "their prompt tokens", "cached share"),
            rows=rows,
        ),
        Block(
            "p",
            "Cached share = cached prompt tokens (usage.prompt_tokens_details.cached_tokens) over the prompt tokens "
            "of the LLM calls and agent episodes whose server reported them; agents resend their context every "
            "turn, so a falling share is a cost regression.",
        ),
    ]


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
class EstimateRow:
    """One stage: the estimate saved when the cycle was opened against what its records add up to. Actual USD is
    the server-reported cost of its calls plus its GPU-hours at the price table (self-hosted serving, training)."""

    stage: str
    estimated_tokens: int | None
    actual_tokens: int
    estimated_gpu_hours: float | None
    actual_gpu_hours: float
    estimated_usd: float | None
    actual_usd: float


def _cost_control(
    ctx: CycleContext, stages: Sequence[StageCost]
) -> tuple[list[BudgetLine], list[EstimateRow], str | None]:
    """Budget lines from the ledger and the saved estimate (`validate_config` stores it in the cycle's provenance
    under "estimate") beside each stage's actuals; the third value says what the estimate was made from."""
    from mass_ops.cost.prices import serving_cost, token_cost, training_cost
    from mass_ops.store.budgets import BudgetLimits

    config = ctx.config
    limits = BudgetLimits.from_mapping(config.budgets.model_dump())
    spend = ctx.repo.budget_spend(ctx.cycle_id)
    order = sorted(spend, key=lambda s: (s != "cycle", s != "in_loop", s))
    budgets = [
        BudgetLine(s, spend[s].tokens, spend[s].cost_usd, spend[s].requests, *limits.for_scope(s)[:2]) for s in order
    ]
    cycle = ctx.repo.get_cycle(ctx.cycle_name)
    saved = (cycle.provenance or {}).get("estimate") if cycle is not None else None
    estimated = {s["stage"]: s for s in (saved or {}).get("stages", [])}
    self_hosted = not config.is_remote_backend and config.models.served_name not in config.prices.models
    actual = {s.stage: s for s in stages}
    rows = []
    for stage in [*estimated, *(s for s in actual if s not in estimated)]:
        e, a = estimated.get(stage), actual.get(stage)
        usd = (a.cost_usd or 0.0) if a else 0.0
        if a is not None and stage == "train":
            usd += training_cost(config.prices, a.gpu_hours)
        elif a is not None and self_hosted:
            usd += serving_cost(config.prices, a.gpu_hours)
        elif a is not None:  # an API policy: its agents' tokens at its per-token price
            usd += token_cost(
                config.prices, config.models.served_name, a.agent_prompt_tokens, a.agent_completion_tokens
            )
        rows.append(
            EstimateRow(
                stage,
                e["prompt_tokens"] + e["completion_tokens"] if e else None,
                a.prompt_tokens + a.completion_tokens if a else 0,
                e["serving_gpu_hours"] + e["training_gpu_hours"] if e else None,
                a.gpu_hours if a else 0.0,
                e["cost_usd"] if e else None,
                usd,
            )
        )
    source = None
    if saved is not None:
        source = f"measured on {saved['lineage_cycle']}" if saved.get("lineage_cycle") else "the documented defaults"
    return budgets, rows, source


def _cost_control_blocks(data: ReportData) -> list[Block]:
    """Spend against budget and the estimate against the actuals per stage (part of the first section)."""
    blocks = [Block("h3", "Spend against budget")]
    if data.budgets:
        rows = tuple(
            (
                b.scope, _int(b.tokens), "none" if b.token_limit is None else _int(b.token_limit),
                f"{b.cost_usd:,.2f}", "none" if b.cost_limit is None else f"{b.cost_limit:,.2f}", str(b.requests),
            )
            for b in data.budgets
        )  # fmt: skip
        headers = ("scope", "tokens", "token budget", "USD (server-reported)", "USD budget", "requests")
        blocks.append(Block("table", headers=headers, rows=rows))
    else:
        blocks.append(Block("p", "No spend is recorded in the budget ledger of this cycle."))
    blocks.append(Block("h3", "Estimate against actual per stage"))
    if data.estimate_source is None:
        blocks.append(Block("p", "No estimate was saved for this cycle (validate_config saves the first one)."))
    rows = tuple(
        (
            r.stage,
            "n/a" if r.estimated_tokens is None else _int(r.estimated_tokens), _int(r.actual_tokens),
            _fmt(r.estimated_gpu_hours, 2), _fmt(r.actual_gpu_hours, 2),
            "n/a" if r.estimated_usd is None else f"{r.estimated_usd:,.2f}", f"{r.actual_usd:,.2f}",
        )
        for r in data.estimate_rows
    )  # fmt: skip
    if rows:
        headers = ("stage", "est. tokens", "tokens", "est. GPU-h", "GPU-h", "est. USD", "USD")
        blocks.append(Block("table", headers=headers, rows=rows))
    if data.estimate_source is not None:
        blocks.append(
            Block(
                "p",
                f"Estimate saved when the cycle was opened, from {data.estimate_source}. Actual USD: the "
                "server-reported cost of calls plus GPU-hours at config.prices (self-hosted serving, training).",
            )
        )
    return blocks


def _provenance_blocks(data: ReportData) -> list[Block]:
    """What the cycle ran with: its task catalogue and the SHA-256 of each prompt template (first section)."""
    text = f"Task catalogue: {data.catalogue}"
    record = data.catalogue_import
    if record is not None:
        files = record.get("files") if isinstance(record.get("files"), dict) else {}
        text += (
            f" — imported from a folder named {record.get('source', '?')!s} at {record.get('imported_at', '?')!s} "
            f"({len(files)} files, each SHA-256 recorded in the cycle row)"
        )
    elif data.catalogue == "builtin":
        text += " — mass-ops' own 12 tasks, not the reference's (`mass-ops tasks import` brings in those)"
    blocks = [Block("p", text + ".")]
    if data.prompts:
        replaced = sum(1 for p in data.prompts if p.shipped is not True)
        blocks.append(
            Block(
                "p",
                f"Prompt templates: {len(data.prompts)} recorded, {replaced} not the shipped text (prompts.dir).",
            )
        )
        rows = tuple(
            (
                p.name,
                p.sha256[:PROMPT_DIGEST_CHARS],
                "shipped" if p.shipped else "replaced" if p.shipped is False else "not shipped by this version",
            )
            for p in data.prompts
        )
        blocks.append(Block("table", headers=("template", "SHA-256 (prefix)", "text"), rows=rows))
    return blocks


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: Sequence[Block], figure_dir: str = "figures") -> str:
    titles = dict(FIGURES)
    lines: list[str] = []
    for block in blocks:
        if block.kind == "title":
            lines += [f"# {block.text}", ""]
        elif block.kind in ("h2", "h3"):
            lines += [f"{'#' * (2 if block.kind == 'h2' else 3)} {block.text}", ""]
        elif block.kind == "p":
            lines += [block.text, ""]
        elif block.kind == "note":
            lines += [f"> **Note.** {block.text}", ""]
        elif block.kind == "table":
            lines.append("| " + " | ".join(_md_cell(h) for h in block.headers) + " |")
            lines.append("|" + "|".join("---" for _ in block.headers) + "|")
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
            lines.append("")
        elif block.kind == "figure":
            lines += [f"![{titles[block.text]}]({figure_dir}/{block.text}.png)", ""]
    return "\n".join(lines).rstrip() + "\n"


_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #222; margin: 0;
       background: #fafafa; }
main { max-width: 1080px; margin: 0 auto; padding: 24px 32px 64px; background: #fff; }
h1 { font-size: 1.7em; border-bottom: 2px solid #3d6f94; padding-bottom: 6px; }
h2 { font-size: 1.3em; margin-top: 2em; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 1.05em; margin-top: 1.4em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.88em; }
th, td { border: 1px solid #d5d5d5; padding: 4px 9px; text-align: left; }
th { background: #eef3f7; }
tr:nth-child(even) td { background: #fafcfd; }
figure { margin: 1em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
.note { background: #fff6e0; border-left: 4px solid #e0a800; padding: 8px 12px; margin: 0.6em 0; }
.meta { color: #555; }
"""


def render_html(blocks: Sequence[Block], figures: Mapping[str, bytes], figure_dir: str = "figures") -> str:
    """A self-contained page: inline CSS, no scripts, each figure's PNG (`figures[name]`) embedded as a data URI and
    wrapped in a link to the published file `<figure_dir>/<name>.png`; a figure missing from `figures` is a KeyError."""
    titles = dict(FIGURES)
    body: list[str] = []
    title = "MASS cycle report"
    for block in blocks:
        text = html.escape(block.text)
        if block.kind == "title":
            title = block.text
            body.append(f"<h1>{text}</h1>")
        elif block.kind in ("h2", "h3"):
            body.append(f"<{block.kind}>{text}</{block.kind}>")
        elif block.kind == "p":
            body.append(f"<p>{text}</p>")
        elif block.kind == "note":
            body.append(f'<div class="note"><strong>Note.</strong> {text}</div>')
        elif block.kind == "table":
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block.headers)
            rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in block.rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif block.kind == "figure":
            caption = html.escape(titles[block.text])
            target = html.escape(f"{figure_dir}/{block.text}.png")
            embedded = "data:image/png;base64," + base64.b64encode(figures[block.text]).decode("ascii")
            body.append(
                f'<figure><a href="{target}"><img src="{embedded}" alt="{caption}"></a>'
                f"<figcaption>{caption}</figcaption></figure>"
            )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n<main>\n"
        + "\n".join(body)
        + "\n</main>\n</body>\n</html>\n"
    )


def write_report(ctx: CycleContext, out_prefix: str | None = None) -> dict[str, Any]:
    """Render and publish the report: figures first, then the Markdown and HTML pages (each atomically).

    Returns ``{"markdown": uri, "html": uri, "figures": {name: uri}}``.
    """
    prefix = (out_prefix or report_prefix(ctx.cycle_name)).rstrip("/")
    data = collect_report_data(ctx)
    blocks = build_blocks(data)
    with tempfile.TemporaryDirectory(prefix="mass-report-") as scratch:
        pngs = {name: path.read_bytes() for name, path in render_figures(data, Path(scratch) / "figures").items()}
    # The page embeds the very bytes published as files, so its images and its links show the same figures.
    figures = {name: ctx.artifacts.put_bytes(f"{prefix}/figures/{name}.png", png).uri for name, png in pngs.items()}
    markdown = ctx.artifacts.put_bytes(f"{prefix}/report.md", render_markdown(blocks).encode("utf-8"))
    page = ctx.artifacts.put_bytes(f"{prefix}/report.html", render_html(blocks, pngs).encode("utf-8"))
    return {"markdown": markdown.uri, "html": page.uri, "figures": figures}
