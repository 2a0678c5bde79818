"""Readers of the stores: `collect_report_data` gathers everything the report shows into one `ReportData`.

This module reads the search, judging, evaluation, benchmark and ranking records; `data_training` reads the
training runs and `data_cost` what each stage used. Nothing is recomputed by calling a model.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from mass_ops.context import CycleContext
from mass_ops.evaluation.agreement import Agreement
from mass_ops.evaluation.benchmarks.mlr import MLR, summarize_mlr
from mass_ops.evaluation.benchmarks.scoring import BenchmarkError, TrialResult, recorded_trials, summarize_trials
from mass_ops.evaluation.benchmarks.table import benchmark_table
from mass_ops.evaluation.efficiency import Efficiency, score_per_output_token
from mass_ops.evaluation.position_bias import FlipRate, flip_rates, order_checks
from mass_ops.evaluation.report.data_cost import budget_alerts, cache_shares, cost_control, stage_costs
from mass_ops.evaluation.report.data_training import loss_curves, ran_on_cpu, throughput_curves, training_runs
from mass_ops.evaluation.report.model import (
    JUDGING_STAGES,
    TRAIN_STAGE,
    DagRun,
    JudgeValidity,
    PairwiseEvaluation,
    PromptDigest,
    RankedTrajectory,
    ReportData,
    TaskScoreboard,
    TrainingData,
    episode_stage,
)
from mass_ops.evaluation.stats import LedgerKeyError, PairwiseSummary, parse_ledger_key
from mass_ops.layout import PAIRWISE_KIND, episode_name, teacher_condition
from mass_ops.llm.calls import CallLedger
from mass_ops.prompts import shipped_prompts
from mass_ops.search.champion import BASELINE_WIN, derive_champion
from mass_ops.store.schema import CallStatus, Ledger, RunStatus, TrainingRun

_BASELINE_KEY = re.compile(r"^v(\d+)_vs_no_harness$")
_ARBITRATION_KEY = re.compile(r"^champion_v(\d+)_vs_v(\d+)$")


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
        kept = retained.get(task)
        if kept is not None:
            champion = kept.version if kept.beats_reference else None
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
                retained_recorded=kept is not None,
            )
        )
    return boards


def _provenance(ctx: CycleContext) -> tuple[str, dict[str, Any] | None, list[PromptDigest]]:
    """(catalogue identity, its import record, prompt templates) as the cycle row recorded them at open time."""
    cycle = ctx.repo.get_cycle(ctx.cycle_name)
    recorded = (cycle.provenance if cycle is not None else None) or {}
    catalogue = _mapping(recorded.get("catalogue")) or {}
    identity = str(catalogue.get("identity") or "not recorded")
    imported = _mapping(catalogue.get("provenance"))
    prompts = _mapping(recorded.get("prompts")) or {}
    shipped = shipped_prompts().digests()
    digests = [
        PromptDigest(str(name), str(sha), None if name not in shipped else shipped[name] == sha)
        for name, sha in sorted(prompts.items())
    ]
    return identity, imported, digests


def _mapping(value: Any) -> dict[str, Any] | None:
    """`value` when it is a dict (a JSON object read from a row), else None."""
    return value if isinstance(value, dict) else None


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


def _training_data(ctx: CycleContext) -> TrainingData | None:
    """The rendered train split (trajectories, windows, tokens, supervised tokens), None before render."""
    dataset = ctx.repo.get_dataset(ctx.cycle_id, "train")
    if dataset is None:
        return None
    return TrainingData(dataset.episodes, dataset.windows, dataset.total_tokens, dataset.loss_tokens)


_UNFINISHED = {"infra_failure": "failed on infrastructure", "budget_exhausted": "stopped by a budget"}


def _failed_stages(ctx: CycleContext, runs: list[TrainingRun]) -> list[str]:
    """Stages whose last attempt of some unit failed (infrastructure, budget) and whose training run failed."""
    latest: dict[tuple[Any, ...], Any] = {}
    for episode in ctx.repo.episodes(ctx.cycle_id):
        unit = (episode.kind, episode.task_id, episode.version, episode.candidate, episode.seed)
        if unit not in latest or episode.attempt > latest[unit].attempt:
            latest[unit] = episode
    failed: dict[str, int] = defaultdict(int)
    for episode in latest.values():
        if episode.status in _UNFINISHED:
            failed[episode_stage(episode.kind)] += 1
    lines = [f"{stage} ({count} episode(s) failed or stopped)" for stage, count in sorted(failed.items())]
    lines += [f"{TRAIN_STAGE} (run {run.key} {run.status})" for run in runs if run.status == RunStatus.FAILED]
    return lines


def _dag_run(environ: Mapping[str, str]) -> DagRun | None:
    """The Airflow DAG run that writes the report, from the variables Airflow's task runner exports to the task
    (`AIRFLOW_CTX_DAG_ID`, `AIRFLOW_CTX_DAG_RUN_ID`); its page on the API server (`AIRFLOW__API__BASE_URL`, else a
    path on the server that serves the report)."""
    dag_id, run_id = environ.get("AIRFLOW_CTX_DAG_ID"), environ.get("AIRFLOW_CTX_DAG_RUN_ID")
    if not dag_id or not run_id:
        return None
    base = (environ.get("AIRFLOW__API__BASE_URL") or "").rstrip("/")
    return DagRun(dag_id, run_id, f"{base}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}")


def collect_report_data(
    ctx: CycleContext, now: datetime | None = None, environ: Mapping[str, str] | None = None
) -> ReportData:
    """Gather the report's content from the stores (and the DAG run that writes it, from `environ`, default the
    process environment)."""
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
    runs = training_runs(ctx)
    data.curves = loss_curves(ctx, runs)
    data.cpu_run = ran_on_cpu(ctx, runs)
    totals = stage_costs(ctx, runs, cpu_run=data.cpu_run)
    data.stages, data.wall_clock_s, data.unbudgeted_tokens = (
        totals.stages,
        totals.wall_clock_s,
        totals.unbudgeted_tokens,
    )
    data.training_data = _training_data(ctx)
    data.failed_stages = _failed_stages(ctx, runs)
    data.dag_run = _dag_run(os.environ if environ is None else environ)
    data.flip_rates = _flip_rates(ctx)
    data.position_bias_sample = config.judge.position_bias_sample
    data.rankings = _rankings(ctx)
    data.throughput = throughput_curves(ctx, runs)
    data.cache_shares = cache_shares(ctx)
    data.budgets, data.estimate_rows, data.estimate_source = cost_control(ctx, data.stages)
    data.budget_alerts = budget_alerts(ctx)
    if not data.own_evaluations:
        data.notes.append("No pairwise evaluation of this cycle is recorded yet (rollouts → pairs → judges → summary).")
    return data
